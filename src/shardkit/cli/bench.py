"""``shardkit bench``: the side-by-side benchmarks (:mod:`shardkit.bench`), from an installed package.

Times shardkit against the tools a user would otherwise pick (torch.save,
safetensors, DCP, ...) and prints one table: median, min and max of
``--reps`` runs, GB/s, peak memory, and each peer's time over shardkit's.
Exit code 0 when every suite ran, 1 when one failed, 2 for bad usage.

Example::

    shardkit bench --size 2GiB --reps 3 --only save,load --json rows.json
"""

from __future__ import annotations

from shardkit.errors import InputError


def register(sub) -> None:
    from shardkit.bench.runner import add_arguments

    p = sub.add_parser("bench", help="run the side-by-side benchmarks (save, load, reshard, HF, comm, DDP)",
                       description="Time shardkit side by side with torch.save, safetensors and DCP; print one table.")
    add_arguments(p)
    p.set_defaults(run=run, _bench_error=p.error)


def run(args) -> int:
    from shardkit.bench.runner import run as run_benchmarks, workdir_problem

    problem = workdir_problem(args.workdir)
    if problem is not None:
        raise InputError(problem)
    return run_benchmarks(args, args._bench_error)

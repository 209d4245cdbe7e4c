"""``shardkit bench`` (or ``python -m shardkit.bench``): shardkit side by side with the tools a user would otherwise pick.

Prints one table (median, min, max of ``--reps`` runs; GB/s; peak memory; and
for every peer the ratio of its time to shardkit's, > 1 meaning shardkit is
faster). ``--json FILE`` also writes the rows. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import traceback

from shardkit.errors import MetadataError
from shardkit.sizes import size_bytes

SUITES = ("save", "load", "async", "multirank", "comm", "hf", "ddp", "offline", "scale", "s3", "comm-gpu",
          "load-any", "gil", "metadata-scale", "incremental", "fsdp2", "hf-in-job")
#: What runs without ``--only``: ``offline`` (the CLI tools against DCP, two extra source checkpoints and
#: rank processes), ``scale`` (8/32/64 ranks as processes, then as threads, tiny tensors; ``--size`` does not apply) and ``s3``
#: (a SeaweedFS server on loopback; needs the ``weed`` binary of requirements-dev.txt) and ``comm-gpu``
#: (an NCCL group's wait modes on one GPU; needs CUDA) and ``load-any`` (``checkpoint.load`` of a Hugging Face
#: and a DCP checkpoint against ``dcp.load``, 4 and 3 rank processes; ``load_any_bench``) and ``gil`` (a tiny
#: Llama trained while background saves are in flight, against ``dcp.async_save``'s two modes; ``gil_bench``)
#: and ``metadata-scale`` (metadata.json of 64..4096 ranks x 1000 FSDP2 tensors simulated in one process:
#: rank 0's commit, the file's size, a loading rank's planning; ``metadata_scale_bench``), ``incremental``
#: (incremental saves against full ones, a 20-step chain's load; ``incremental_bench``), ``fsdp2`` (an
#: FSDP2 + Adam state saved on 4 rank processes and loaded on 3; ``dtensor_bench``) and ``hf-in-job`` (a
#: Hugging Face export of a DTensor state from 4 ranks; ``hf_in_job_bench``) run only when asked for.
DEFAULT_SUITES = ("save", "load", "async", "multirank", "comm", "hf", "ddp")


#: The state size when ``--size`` is not given, per suite (the others: ``DEFAULT_SIZE``).
DEFAULT_SIZE = "1GiB"
SUITE_DEFAULT_SIZES = {"s3": "512MiB", "load-any": "512MiB", "gil": "300MiB", "hf-in-job": "512MiB"}


def _run_suite(name: str, size: int, reps: int, workdir: str) -> list[dict]:
    if name in ("save", "load", "async"):
        from shardkit.bench.checkpoint_suites.checkpoint_bench import run_checkpoint_benchmarks

        return run_checkpoint_benchmarks(size, reps, workdir, cases=(name,))
    if name == "multirank":
        from shardkit.bench.checkpoint_suites.multirank_bench import run_multirank_benchmarks

        return run_multirank_benchmarks(size, reps, workdir)
    if name == "comm":
        from shardkit.bench.comm_suites.comm_bench import run_comm_benchmarks

        return run_comm_benchmarks(reps=reps)
    if name == "offline":
        from shardkit.bench.checkpoint_suites.offline_bench import run_offline_benchmarks

        return run_offline_benchmarks(size, reps, workdir)
    if name == "scale":
        from shardkit.bench.checkpoint_suites.scale_bench import run_scale_benchmarks

        return run_scale_benchmarks(workdir)
    if name == "s3":
        from shardkit.bench.checkpoint_suites.s3_bench import run_s3_benchmarks

        return run_s3_benchmarks(size, reps, workdir)
    if name == "comm-gpu":
        from shardkit.bench.comm_suites.comm_gpu_bench import run_comm_gpu_benchmarks

        return run_comm_gpu_benchmarks(reps=reps)
    if name == "load-any":
        from shardkit.bench.checkpoint_suites.load_any_bench import run_load_any_benchmarks

        return run_load_any_benchmarks(size, reps, workdir)
    if name == "gil":
        from shardkit.bench.checkpoint_suites.gil_bench import run_gil_benchmarks

        return run_gil_benchmarks(size, reps, workdir)
    if name == "metadata-scale":
        from shardkit.bench.checkpoint_suites.metadata_scale_bench import run_metadata_scale_benchmarks

        return run_metadata_scale_benchmarks(workdir, reps=reps)
    if name == "incremental":
        from shardkit.bench.checkpoint_suites.incremental_bench import run_incremental_benchmarks

        return run_incremental_benchmarks(size, reps, workdir)
    if name == "fsdp2":
        from shardkit.bench.checkpoint_suites.dtensor_bench import run_dtensor_benchmarks

        return run_dtensor_benchmarks(size, reps, workdir)
    if name == "hf-in-job":
        from shardkit.bench.hf_suites.hf_in_job_bench import run_hf_in_job_benchmarks

        return run_hf_in_job_benchmarks(size, reps, workdir)
    if name == "ddp":
        from shardkit.bench.comm_suites.ddp_bench import run_ddp_benchmarks

        return run_ddp_benchmarks(reps=reps)
    from shardkit.bench.hf_suites.hf_bench import run_hf_benchmarks

    return run_hf_benchmarks(size, reps, workdir)


def workdir_problem(workdir: str | None) -> str | None:
    """What is wrong with ``--workdir`` (it must be an existing directory), or None."""
    if workdir is None or os.path.isdir(workdir):
        return None
    return f"--workdir {workdir} is not an existing directory; create it, or leave --workdir out for a temp dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark options, shared by ``shardkit bench`` and ``python -m shardkit.bench``."""
    parser.add_argument("--size", default=None,
                        help=f"state size, e.g. 64MiB, 2GiB (powers of 2) or 500MB (of 10), as transformers reads them "
                             f"(default {DEFAULT_SIZE}; s3: {SUITE_DEFAULT_SIZES['s3']})")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (default 3, min 1)")
    parser.add_argument("--only", default=",".join(DEFAULT_SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows to this JSON file")


def main(argv: list[str] | None = None, *, prog: str = "python -m shardkit.bench") -> int:
    """Parse ``argv`` and run the chosen suites; 0 when every suite ran, 1 when one failed.

    >>> main(["--size", "1MiB", "--reps", "1", "--only", "save"])
    0
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), parser.error)


def run(args: argparse.Namespace, error=None) -> int:
    """Run the suites ``args`` names (``args`` as :func:`add_arguments` defines them)."""
    from shardkit.bench.common import format_table, write_json

    problem = workdir_problem(args.workdir)
    if problem is not None:
        if error is None:
            raise ValueError(problem)
        error(problem)
    try:
        size = size_bytes(args.size or DEFAULT_SIZE, what="--size")
    except MetadataError as e:
        if error is None:
            raise
        error(str(e))
    suites = [s for s in args.only.split(",") if s]
    unknown = set(suites) - set(SUITES)
    if unknown:
        if error is None:
            raise ValueError(f"unknown suite(s) {sorted(unknown)}; choose from {', '.join(SUITES)}")
        error(f"unknown suite(s) {sorted(unknown)}; choose from {', '.join(SUITES)}")
    from shardkit.storage.fast_io.memcopy import copy_kind

    context = {"size_bytes": size, "reps": args.reps, "machine": platform.platform(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "staging_copy": copy_kind()}
    rows: list[dict] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="shardkit-bench-") as workdir:
        for suite in suites:
            print(f"running {suite} ...", file=sys.stderr, flush=True)
            try:
                suite_size = size if args.size else size_bytes(SUITE_DEFAULT_SIZES.get(suite, DEFAULT_SIZE))
                suite_rows = _run_suite(suite, suite_size, args.reps, workdir)
            except Exception:  # noqa: BLE001 - one broken suite must not cost the others' figures
                traceback.print_exc()
                print(f"suite {suite} failed; going on with the others", file=sys.stderr, flush=True)
                failed.append(suite)
                continue
            rows += suite_rows
            print(format_table(suite_rows), file=sys.stderr, flush=True)  # progress, kept if a later suite dies
            if args.json_path:
                write_json(rows, args.json_path, **context, failed_suites=failed)
    own = [f"{s}: {SUITE_DEFAULT_SIZES[s]}" for s in suites if s in SUITE_DEFAULT_SIZES]
    sizes = args.size or DEFAULT_SIZE + (f" ({', '.join(own)})" if own else "")
    print(f"shardkit benchmarks — state {sizes}, {args.reps} reps, {os.cpu_count()} CPUs, "
          f"{platform.machine()}, staging copies: {copy_kind()}")
    print(format_table(rows))
    if failed:
        print(f"failed suites: {', '.join(failed)} (tracebacks above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

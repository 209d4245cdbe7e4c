"""``shardkit bench``: the side-by-side benchmarks (``python -m benchmarks``), from a checkout."""

from __future__ import annotations

import os

from shardkit.cli.target import InputError


def register(sub) -> None:
    p = sub.add_parser("bench", help="run the side-by-side benchmarks (from a source checkout)",
                       description=__doc__, add_help=False)
    p.add_argument("rest", nargs="...", help="arguments for python -m benchmarks (try --help)")
    p.set_defaults(run=run)


def run(args) -> int:
    workdir = _option(args.rest, "--workdir")
    if workdir is not None and not os.path.isdir(workdir):
        raise InputError(f"--workdir {workdir} is not an existing directory")
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError as e:
        raise InputError("the benchmarks ship with the source, not the wheel; run it from a checkout of "
                         "shardkit (its root on the current directory)") from e
    return bench_main(args.rest)


def _option(rest: list[str], flag: str) -> str | None:
    for i, arg in enumerate(rest):
        if arg == flag and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None

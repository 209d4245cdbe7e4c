"""``shardkit bench``: the side-by-side benchmarks (``python -m benchmarks``), from a checkout."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("bench", help="run the side-by-side benchmarks (from a source checkout)",
                       description=__doc__, add_help=False)
    p.add_argument("rest", nargs="...", help="arguments for python -m benchmarks (try --help)")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError:
        print("shardkit bench: the benchmarks ship with the source, not the wheel; run it from a "
              "checkout of shardkit (its root on the current directory)", file=sys.stderr)
        return 2
    return bench_main(args.rest)

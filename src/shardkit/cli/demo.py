"""``shardkit demo``: save a state on 4 ranks, reshard it to 3, verify every byte."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="save on 4 ranks, load on 3, verify, and show what happened",
                       description=__doc__)
    p.add_argument("path", nargs="?", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.set_defaults(run=run)


def run(args) -> int:
    from shardkit.demo import run_demo

    return run_demo(args.path)

"""``shardkit demo``: save a state on 4 ranks, reshard it to 3, verify every byte."""

from __future__ import annotations

import os

from shardkit.cli.target import InputError


def register(sub) -> None:
    p = sub.add_parser("demo", help="save on 4 ranks, load on 3, verify, and show what happened",
                       description=__doc__)
    p.add_argument("path", nargs="?", default=None,
                   help="a new or empty directory to write the checkpoint to (default: a temp dir)")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.path is not None:
        _check_target(args.path)
    from shardkit.demo import run_demo  # imports torch: after the cheap checks

    return run_demo(args.path)


def _check_target(path: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"{path} exists and is not a directory; pass a new or empty directory")
    if os.path.isdir(path) and os.listdir(path):
        raise InputError(f"{path} is not empty; pass a new or empty directory (the demo writes a checkpoint there)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"{parent} does not exist; create it first, or pass another path")

"""The ``shardkit`` command: inspect, validate, demo and bench.

Each subcommand lives in its own module and registers itself in :func:`main`'s
parser. Exit codes: 0 success, 1 the checked thing is bad (e.g. an incomplete
checkpoint), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import sys

from shardkit.errors import ShardkitError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from shardkit import __version__
    from shardkit.cli import bench, convert, demo, diff, inspect_cmd, reshard, validate

    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="Distributed checkpoints that reshard, Hugging Face shards, and the tools around them.",
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (inspect_cmd, validate, diff, reshard, convert, demo, bench):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ShardkitError as e:
        print(f"shardkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

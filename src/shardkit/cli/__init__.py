"""The ``shardkit`` command: inspect, validate, demo and bench.

Each subcommand lives in its own module and registers itself in :func:`main`'s
parser. Errors never print a traceback: every subcommand's errors come back
through :func:`main`, the one error path: one line on stderr, and the exit
code ``cli.exit_codes`` gives the error (a subcommand may set
``damaged_exit``: ``diff`` answers a damaged checkpoint with 2, its 1 meaning
"they differ"). Set ``SHARDKIT_DEBUG=1`` to get the traceback too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from shardkit.cli._tools import setup_logging
from shardkit.cli.exit_codes import (EXIT_BROKEN_PIPE, EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE,
                                     exit_code_for)
from shardkit.errors import ShardkitError

__all__ = ["main", "build_parser", "EXIT_CODES"]

def build_parser() -> argparse.ArgumentParser:
    from shardkit import __version__
    from shardkit.cli import bench, convert, demo, diff, inspect_cmd, reshard, validate

    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="Distributed checkpoints that reshard, Hugging Face shards, and the tools around them.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (inspect_cmd, validate, diff, reshard, convert, demo, bench):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints usage and exits 2
    try:
        setup_logging(args)
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()  # the reader (e.g. `| head`) has all it wanted: no message
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return _fail(args, "interrupted", EXIT_INTERRUPTED)
    except ShardkitError as e:
        return _fail(args, str(e) or type(e).__name__, _exit_code(args, e))
    except OSError as e:  # the environment: permissions, a vanished file, a full disk
        return _fail(args, f"{type(e).__name__}: {e}", _exit_code(args, e))
    except Exception as e:  # noqa: BLE001 -- a bug: still one line, with the way to see more
        hint = "" if _debug() else " (an internal error; set SHARDKIT_DEBUG=1 for the traceback, and report it)"
        return _fail(args, f"{type(e).__name__}: {e}{hint}", EXIT_INTERNAL)


def _exit_code(args, error: BaseException) -> int:
    """``exit_code_for(error)``, or the subcommand's ``damaged_exit`` for a damaged checkpoint."""
    code = exit_code_for(error)
    damaged = getattr(args, "damaged_exit", None)
    return code if damaged is None or code == EXIT_USAGE else damaged


def _fail(args, message: str, code: int) -> int:
    if _debug():
        traceback.print_exc()
    one_line = " ".join(message.split())
    try:
        print(f"shardkit {args.command}: error: {one_line}", file=sys.stderr)
    except (BrokenPipeError, OSError):
        pass
    _flush_quietly()
    return code


def _debug() -> bool:
    return os.environ.get("SHARDKIT_DEBUG", "") not in ("", "0")


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        _silence_stdout()


def _silence_stdout() -> None:
    # Point stdout at /dev/null so the interpreter's final flush cannot raise
    # (and print "Exception ignored ... BrokenPipeError") on the closed pipe.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())

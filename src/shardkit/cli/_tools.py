"""What the reshard / convert / diff subcommands share: options, logging, progress, one-line errors.

``add_common`` adds ``--quiet`` and ``-v/--verbose`` (INFO; ``-vv`` DEBUG)
for the ``shardkit.*`` loggers; :func:`progress_bar` is a tqdm bar on stderr,
off with ``--quiet`` or when stderr is not a terminal; :func:`guarded` turns
an error into one line on stderr and the exit code ``cli.exit_codes`` gives
it (1 for a damaged checkpoint, 2 for bad input), never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from shardkit.cli.exit_codes import EXIT_USAGE, exit_code_for
from shardkit.errors import ShardkitError

__all__ = ["add_common", "guarded", "progress_bar", "setup_logging"]


def add_common(p) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what is done (shardkit.* loggers): -v INFO, -vv DEBUG")


def setup_logging(args) -> None:
    if not getattr(args, "verbose", 0):
        return
    level = logging.INFO if args.verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("shardkit")
    logger.addHandler(handler)
    logger.setLevel(level)


@contextlib.contextmanager
def progress_bar(args, total_bytes: int, desc: str):
    """Yield ``update(nbytes)``; draws a tqdm bar unless ``--quiet`` or stderr is not a terminal."""
    disabled = getattr(args, "quiet", False) or not sys.stderr.isatty()
    if disabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              leave=False) as bar:
        yield bar.update


def guarded(command: str, run, *, damaged_exit: int | None = None):
    """``run(args)`` with shardkit's errors answered by one line on stderr and an exit code: 1 for a
    damaged or incomplete checkpoint (``damaged_exit`` instead, when given: ``diff`` says 2, its 1
    meaning "they differ"), 2 for bad input (a missing file, a taken destination, a refused value).

    Only typed errors (``ShardkitError``, ``OSError``) are answered here; bad input the CLI finds
    itself is ``shardkit.errors.InputError`` (2). Anything else, a bare ``ValueError`` or ``TypeError``
    included, is a bug and goes on to ``cli.main``: exit 3, "internal error", as in inspect and validate.
    """

    def wrapper(args) -> int:
        setup_logging(args)
        try:
            return int(run(args) or 0)
        except (ShardkitError, OSError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"shardkit {command}: error: {message}", file=sys.stderr)
            code = exit_code_for(e)
            return code if damaged_exit is None or code == EXIT_USAGE else damaged_exit

    return wrapper

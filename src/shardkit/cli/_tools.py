"""What the reshard / convert / diff subcommands share: options, logging, progress.

``add_common`` adds ``--quiet`` and ``-v/--verbose`` (INFO; ``-vv`` DEBUG)
for the ``shardkit.*`` loggers (``setup_logging``, called by ``cli.main`` for
every subcommand); :func:`progress_bar` is a tqdm bar on stderr, off with
``--quiet`` or when stderr is not a terminal. Errors are not answered here:
every subcommand's errors go to ``cli.main``, the one error path.
"""

from __future__ import annotations

import contextlib
import logging
import sys


__all__ = ["add_common", "progress_bar", "setup_logging"]


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

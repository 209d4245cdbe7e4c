"""Build a directory under a temporary sibling name, check it, then rename it into place (all or nothing).

A kill at any moment leaves either no destination or the complete one: the
build happens in ``.<name>.partial-<pid>`` beside the destination, and only
a finished, checked directory is renamed (one ``rename``, then an fsync of
the parent). An existing destination is refused, never overwritten. A
leftover ``.partial`` directory from a killed run is not a checkpoint
(no reader looks for that name); remove it at leisure.

Example::

    publish_directory("out/ckpt", lambda tmp: write_everything(tmp), check=lambda tmp: [])
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable

from shardkit.errors import CheckpointError, CheckpointExistsError
from shardkit.storage import fsync_dir

__all__ = ["publish_directory", "partial_name"]

log = logging.getLogger("shardkit.offline")


def partial_name(dst: str) -> str:
    """The temporary sibling ``dst`` is built in."""
    parent, name = os.path.split(os.path.abspath(dst))
    return os.path.join(parent, f".{name}.partial-{os.getpid()}")


def publish_directory(dst: str, build: Callable[[str], None], check: Callable[[str], list]) -> None:
    """Run ``build(tmp)``, then ``check(tmp)`` (a list of problems), then rename ``tmp`` to ``dst``.

    Raises :class:`CheckpointExistsError` if ``dst`` exists (before any work),
    :class:`CheckpointError` if ``check`` finds problems; on any failure the
    temporary directory is removed and ``dst`` is not created. Local paths only.
    """
    if "://" in dst:
        raise CheckpointError(f"{dst}: offline tools write local directories only; write locally, then copy")
    if os.path.lexists(dst):
        raise CheckpointExistsError(f"{dst} already exists; choose a new destination or remove it first "
                                    f"(shardkit never overwrites a checkpoint in place)")
    tmp = partial_name(dst)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        build(tmp)
        problems = check(tmp)
        if problems:
            raise CheckpointError(f"the written checkpoint did not check out ({len(problems)} problem(s)): "
                                  f"{problems[0]}; nothing was published at {dst}")
        log.info("publishing %s -> %s", tmp, dst)
        os.rename(tmp, dst)
        fsync_dir(os.path.dirname(os.path.abspath(dst)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

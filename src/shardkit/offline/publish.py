"""Build a directory under a temporary sibling name, check it, then rename it into place (all or nothing).

A kill at any moment leaves either no destination or the complete one: the
build happens in ``.<name>.partial-<pid>`` beside the destination, and only
a finished, checked directory is renamed (one ``rename``, then an fsync of
the parent). An existing destination is refused, never overwritten. A
leftover ``.partial`` directory from a killed run is not a checkpoint
(no reader looks for that name); remove it at leisure. On an object store
(no rename) the destination is written in place, its commit file last.

Example::

    publish_directory("out/ckpt", lambda tmp: write_everything(tmp), check=lambda tmp: [])
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Callable

from shardkit.errors import CheckpointError, CheckpointExistsError
from shardkit.storage import Storage, fsync_dir, storage_for

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
    temporary directory is removed and ``dst`` is not created. ``dst`` may be
    a URL (``storage_for``): where the storage cannot rename a directory
    (object stores: ``Storage.renames_directories`` is False) ``build`` writes
    ``dst`` itself, commit file last as every writer does, so a killed run
    leaves an incomplete ``dst`` that no reader counts (remove it to retry).
    """
    store, path = storage_for(dst)
    if store.exists(path) or (store.renames_directories and os.path.lexists(path)):
        raise CheckpointExistsError(f"{dst} already exists; choose a new destination or remove it first "
                                    f"(shardkit never overwrites a checkpoint in place)")
    if not store.renames_directories:
        _build_in_place(store, path, build, check)
        return
    dst = path
    tmp = partial_name(dst)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _build_and_check(tmp, dst, build, check)
        log.info("publishing %s -> %s", tmp, dst)
        os.rename(tmp, dst)
        fsync_dir(os.path.dirname(os.path.abspath(dst)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _build_and_check(where: str, dst: str, build: Callable[[str], None], check: Callable[[str], list]) -> None:
    build(where)
    problems = check(where)
    if problems:
        raise CheckpointError(f"the written checkpoint did not check out ({len(problems)} problem(s)): "
                              f"{problems[0]}; nothing was published at {dst}")


def _build_in_place(store: Storage, path: str, build: Callable[[str], None], check: Callable[[str], list]) -> None:
    store.makedirs(path)
    try:
        _build_and_check(path, path, build, check)
    except BaseException:
        with contextlib.suppress(Exception):   # the build's own error is the one to report
            store.remove_tree(path)
        raise

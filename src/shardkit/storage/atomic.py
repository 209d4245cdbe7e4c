"""Files that appear whole or not at all (FORMAT.md invariant 1).

Write to a temporary name in the same directory, flush, fsync, rename over
the final name, fsync the directory. A crash at any point leaves either the
old file (or none) or the complete new one; the temporary name starts with
``.`` and ends with ``.tmp`` so listings and validators skip it. This module
does not create directories.

Example::

    with atomic_local_writer("/ckpt/metadata.json") as f:
        f.write(json_bytes)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import BinaryIO, Iterator

__all__ = ["atomic_local_writer", "fsync_dir", "is_temp_name"]

_TMP_SUFFIX = ".tmp"


def is_temp_name(name: str) -> bool:
    """True for the temporary names :func:`atomic_local_writer` uses."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


def fsync_dir(path: str) -> None:
    """Make a rename or removal in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_local_writer(path: str) -> Iterator[BinaryIO]:
    """Yield an unbuffered binary file; publish it at ``path`` when the block exits cleanly."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
    f = open(tmp, "xb", buffering=0)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise

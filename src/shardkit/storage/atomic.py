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
import ctypes
import os
import secrets
import sys
from typing import BinaryIO, Iterator

from shardkit import knobs

__all__ = ["atomic_local_writer", "fsync_dir", "is_temp_name", "start_writeback", "temp_name"]

_TMP_SUFFIX = ".tmp"


def temp_name(name: str) -> str:
    """The temporary name a file ``name`` is written under before it is published.

    The one convention of every backend (``.<name>.<8 hex>.tmp``, in the same
    directory), so listings, validators and clean-up recognise leftovers of a
    killed writer with :func:`is_temp_name`. Example: ``temp_name("a.json")``
    is ``".a.json.3f9c01ab.tmp"``.
    """
    return f".{name}.{secrets.token_hex(4)}{_TMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """True for the temporary names of :func:`temp_name` (a base name, not a path)."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


def fsync_dir(path: str) -> None:
    """Make a rename or removal in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range():
    """libc's sync_file_range on Linux, else None (then writeback starts at fsync)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk; returns at once.

    A no-op where ``sync_file_range`` is missing. Durability still comes
    from the fsync at publish time; this only moves the disk work earlier.
    """
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class _EarlyWritebackFile:
    """An unbuffered file that asks the kernel to start writing each chunk out
    as soon as it is written, so the disk works while we still fill the page
    cache and the final fsync has little left to do. Other file methods
    (``tell``, ``flush``, ...) go to the underlying file."""

    def __init__(self, raw):
        self._raw = raw
        self._written = 0
        self._started = 0

    def write(self, data) -> int:
        n = self._raw.write(data)
        self._written += n
        if self._written - self._started >= knobs.WRITEBACK_BYTES:
            start_writeback(self._raw.fileno(), self._started, self._written - self._started)
            self._started = self._written
        return n

    def __getattr__(self, name):
        return getattr(self._raw, name)


@contextlib.contextmanager
def atomic_local_writer(path: str, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield an unbuffered binary file; publish it at ``path`` when the block exits cleanly.

    ``durable`` (the default): writeback starts as the data is written, the
    file is fsync'd before the rename and the directory after it, so the
    published file survives a power loss. ``durable=False`` keeps only the
    all-or-nothing rename (readers never see a partial file; after a power
    loss the file may be empty or missing), as ``torch.save`` and
    ``safetensors`` give.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, temp_name(name))
    f = open(tmp, "xb", buffering=0)
    try:
        yield _EarlyWritebackFile(f) if durable else f
        if durable:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        if durable:
            fsync_dir(directory)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise

"""Files that appear whole or not at all (``docs/format.md``, invariant 1).

Write to a temporary name in the same directory, flush, fsync, rename over
the final name, fsync the directory. A crash at any point leaves either the
old file (or none) or the complete new one; the temporary name starts with
``.`` and ends with ``.tmp`` so listings and validators skip it. This module
does not create directories.

It is also where a failed local write gets its type: a full disk or quota, a
read-only file system or a refused permission becomes a
:class:`~shardkit.errors.CheckpointIOError` (still an ``OSError``, same
``errno``) whose message names the file and says what to do, also when the
writer was ``torch.save`` (which reports only "file write failed").

Example::

    with atomic_local_writer("/ckpt/metadata.json") as f:
        f.write(json_bytes)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from typing import BinaryIO, Iterator

from shardkit import knobs
from shardkit.errors import CheckpointIOError
from shardkit.storage.fast_io.libc import linux_function

__all__ = ["atomic_local_writer", "checkpoint_io_error", "fsync_dir", "is_temp_name", "start_writeback",
           "temp_name", "typed_io_errors"]

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


def makedirs_synced(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, then sync each new directory's entry into its parent
    (top down), so what is committed inside later survives a power loss with its directories."""
    missing, here = [], os.path.abspath(path)
    while not os.path.isdir(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    os.makedirs(path, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(os.path.dirname(created))


# libc's sync_file_range on Linux, else None (then writeback starts at fsync)
_SYNC_FILE_RANGE = linux_function("sync_file_range",
                                  [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk; returns at once.

    A no-op where ``sync_file_range`` is missing. Durability still comes
    from the fsync at publish time; this only moves the disk work earlier.
    """
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


#: errno -> (what happened, what to do about it)
_IO_FAILURES = {
    errno.ENOSPC: ("the disk is full", "Free space (e.g. delete old checkpoints) or save to another disk"),
    errno.EDQUOT: ("the disk quota is used up", "Free space within the quota, raise the quota, or save elsewhere"),
    errno.EROFS: ("the file system is read-only", "Remount it read-write, or save to a writable directory"),
    errno.EACCES: ("permission was denied", "Give this user (uid {uid}) write permission on {dir}, or save "
                   "to a directory it owns"),
    errno.EPERM: ("the operation was not permitted", "Give this user (uid {uid}) write permission on {dir}, "
                  "or save to a directory it owns"),
}

_NOTHING_PUBLISHED = ("Nothing was published under that name: the file there before (if any) and every "
                      "checkpoint already saved are untouched, and the partial temporary file was removed.")


def checkpoint_io_error(e: BaseException, path: str, doing: str,
                        outcome: str = _NOTHING_PUBLISHED) -> CheckpointIOError | None:
    """The :class:`CheckpointIOError` for ``e`` hit while ``doing`` ``path``; None unless ``e`` is an
    ``OSError`` of a full disk or quota, a read-only file system or a refused permission.

    >>> checkpoint_io_error(OSError(errno.ENOSPC, "No space left on device"), "/ck/a", "write").errno
    28
    """
    if isinstance(e, CheckpointIOError) or not isinstance(e, OSError) or e.errno not in _IO_FAILURES:
        return None
    what, fix = _IO_FAILURES[e.errno]
    directory = os.path.dirname(os.path.abspath(path))
    fix = fix.format(uid=os.geteuid() if hasattr(os, "geteuid") else "?", dir=directory)
    return CheckpointIOError(
        f"could not {doing} {path}: {what} ({errno.errorcode[e.errno]}: {e.strerror}). {outcome} "
        f"{fix}, then save again.", e.errno, e.strerror, e.filename if e.filename is not None else path)


@contextlib.contextmanager
def typed_io_errors(path: str, doing: str, outcome: str) -> Iterator[None]:
    """Raise :func:`checkpoint_io_error`'s typed error (chained) for an ``OSError`` in the block."""
    try:
        yield
    except OSError as e:
        typed = checkpoint_io_error(e, path, doing, outcome)
        if typed is None:
            raise
        raise typed from e


class _LocalFile:
    """An unbuffered file whose ``write`` writes every byte it is given (retrying short
    writes), that remembers the ``OSError`` a write raised (``torch.save`` turns it into
    a bare ``RuntimeError``) and, with ``writeback``, asks the kernel to start writing
    each chunk out as soon as it is written, so the disk works while we still fill the
    page cache and the final fsync has little left to do. Other file methods (``tell``,
    ``flush``, ...) go to the underlying file."""

    def __init__(self, raw, writeback: bool):
        self._raw = raw
        self._writeback = writeback
        self._written = 0
        self._started = 0
        self.write_error: OSError | None = None

    def write(self, data) -> int:
        """Write all of ``data`` (a raw write may take less: Linux caps one at just under 2 GiB,
        and ``torch.save`` ignores the count), then return its length."""
        view = memoryview(data)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        n = 0
        try:
            while n < view.nbytes:
                n += self._raw.write(view[n:])
        except OSError as e:
            self.write_error = e
            raise
        self._written += n
        if self._writeback and self._written - self._started >= knobs.WRITEBACK_BYTES:
            start_writeback(self._raw.fileno(), self._started, self._written - self._started)
            self._started = self._written
        return n

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _own_write_failure(e: BaseException, f: _LocalFile, names: tuple[str, ...]) -> BaseException | None:
    """The ``OSError`` behind ``e`` if it came from writing this file, else None (e.g. a lazy
    tensor's loader failing to read another file must keep its own error)."""
    if isinstance(e, OSError) and (e.filename is None or os.fspath(e.filename) in names):
        return e
    return f.write_error


@contextlib.contextmanager
def atomic_local_writer(path: str, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield an unbuffered binary file; publish it at ``path`` when the block exits cleanly.

    ``durable`` (the default): writeback starts as the data is written, the
    file is fsync'd before the rename and the directory after it, so the
    published file survives a power loss. ``durable=False`` keeps only the
    all-or-nothing rename (readers never see a partial file; after a power
    loss the file may be empty or missing), as ``torch.save`` and
    ``safetensors`` give. A full disk, a read-only file system or a refused
    permission, in the block or here, raises ``CheckpointIOError``.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, temp_name(name))
    with typed_io_errors(path, "create a temporary file in the directory of",
                         "Nothing was written: every file already there is untouched."):
        raw = open(tmp, "xb", buffering=0)
    f = _LocalFile(raw, durable)
    published = False
    try:
        yield f
        if durable:
            os.fsync(raw.fileno())
        raw.close()
        os.replace(tmp, path)
        published = True
        if durable:
            fsync_dir(directory)
    except BaseException as e:
        raw.close()
        if not published:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        cause = _own_write_failure(e, f, (tmp, path, directory))
        typed = cause and checkpoint_io_error(
            cause, path, "write", _NOTHING_PUBLISHED if not published else
            "The file was renamed into place but its directory could not be synced: it may be "
            "missing after a power loss.")
        if typed is not None:
            raise typed from e
        raise

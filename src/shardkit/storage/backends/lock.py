"""One writer per checkpoint directory: a lock file held with ``fcntl.flock``.

:func:`local_writer_lock` takes an exclusive, non-blocking ``flock`` on a
hidden lock file inside the directory (``.shardkit-writer.lock``, or
``.shardkit-writer-<slot>.lock`` for slot > 0) and writes who holds it
(pid, host, since when, what) into it. A second writer fails at once with
:class:`~shardkit.errors.CheckpointBusyError` naming the first. The kernel
drops the lock when its holder dies (a SIGKILL included), so a dead writer
never leaves it stuck; the file it leaves behind is reused by the next writer.
Released cleanly, the file is removed (then the lock dropped), so a finished
save leaves nothing behind.

What it does not do: it does not wait for the other writer, and it does not
lock readers out. Children forked while a lock is held close their copy of
the descriptor at once (``os.register_at_fork``) and never unlink the file,
so a worker process that outlives its parent never keeps a checkpoint
locked; ``O_CLOEXEC`` does the same for ``exec``. On NFS, Linux emulates
``flock`` with POSIX byte-range locks, which the server arbitrates; other
network file systems may lock only per client, and one that refuses
``flock`` outright (Lustre mounted ``noflock``: ENOSYS) gets a
``RuntimeWarning`` and a save that holds no lock, rather than no save. Lock files are named so that
:func:`is_lock_name` tells them apart; no index, manifest or listing of
checkpoint files counts them.

Example::

    with local_writer_lock("/ckpt/step-100", holder="save_distributed rank 0 of 4"):
        ...  # write the checkpoint; another writer gets CheckpointBusyError meanwhile
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import warnings
from typing import Iterator

from shardkit.errors import CheckpointBusyError
from shardkit.storage.backends.atomic import makedirs_synced, typed_io_errors

__all__ = ["LOCK_FILE_PREFIX", "is_lock_name", "local_writer_lock", "lock_file_name"]

LOCK_FILE_PREFIX = ".shardkit-writer"
_LOCK_SUFFIX = ".lock"
_MAX_HOLDER_BYTES = 4096

# Descriptors of the locks this process holds: closed in forked children.
_held_fds: set[int] = set()
_held_guard = threading.Lock()


def lock_file_name(slot: int = 0) -> str:
    """The lock file's base name for ``slot`` (0: the directory's main writer)."""
    if slot < 0:
        raise ValueError(f"a lock slot is >= 0, got {slot}")
    return f"{LOCK_FILE_PREFIX}{_LOCK_SUFFIX}" if slot == 0 else f"{LOCK_FILE_PREFIX}-{slot}{_LOCK_SUFFIX}"


def is_lock_name(name: str) -> bool:
    """True for the names of writer lock files (never part of a checkpoint)."""
    return name.startswith(LOCK_FILE_PREFIX) and name.endswith(_LOCK_SUFFIX)


@contextlib.contextmanager
def local_writer_lock(directory: str, *, slot: int = 0, holder: str = "") -> Iterator[None]:
    """Hold the writer lock ``slot`` of ``directory`` (created if missing) for the block.

    Raises :class:`~shardkit.errors.CheckpointBusyError` at once when another
    process (or another open in this one) holds it.
    """
    path = os.path.join(directory, lock_file_name(slot))
    with typed_io_errors(path, "take the writer lock", "Nothing was written; every checkpoint already saved is untouched."):
        makedirs_synced(directory)
        fd = _acquire(path, holder)
    if fd is None:
        yield
        return
    owner_pid = os.getpid()
    try:
        yield
    finally:
        if os.getpid() == owner_pid:   # a forked child leaving the block must not unlink the parent's lock
            _release(path, fd)


def _acquire(path: str, holder: str) -> int | None:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            other = _read_holder(fd)
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                _unlocked(path, e, remove=e.errno != errno.ENOLCK)
                return None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise CheckpointBusyError(_busy_message(path, other)) from e
        try:
            named = _still_named(fd, path)
        except BaseException:
            os.close(fd)  # locked: an error here must not keep the directory locked until exit
            raise
        if named:
            break
        os.close(fd)  # the holder unlinked it as we opened it: lock the file now under that name
    with _held_guard:
        _held_fds.add(fd)
    with contextlib.suppress(OSError):  # who holds it is for messages only: a full disk must not stop the save here
        _write_holder(fd, holder)
    return fd


_UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}


def _unlocked(path: str, e: OSError, *, remove: bool) -> None:
    # ENOLCK (out of lock records, or NFS's lock daemon unreachable) may pass: another
    # writer may hold the file's lock, so only a file system without flock loses the file.
    if remove:
        with contextlib.suppress(OSError):
            os.remove(path)
    warnings.warn(f"the file system of {os.path.dirname(path)} refuses flock ({e}); this save holds no "
                  f"writer lock, so make sure no other save writes that directory at the same time",
                  RuntimeWarning, stacklevel=4)


def _still_named(fd: int, path: str) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def _release(path: str, fd: int) -> None:
    # Unlink while still holding: whoever opened this file meanwhile then finds it
    # no longer under its name and opens a fresh one (see _still_named).
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    with _held_guard:
        _held_fds.discard(fd)
    os.close(fd)


def _write_holder(fd: int, holder: str) -> None:
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "holder": holder}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)


def _read_holder(fd: int) -> dict:
    try:
        value = json.loads(os.pread(fd, _MAX_HOLDER_BYTES, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _busy_message(path: str, other: dict) -> str:
    if other:
        who = (f"pid {other.get('pid', '?')} on host {other.get('host', '?')}, writing since "
               f"{other.get('since', '?')}" + (f" ({other['holder']})" if other.get("holder") else ""))
    else:
        who = "a writer that has not recorded its pid yet"
    return (f"{os.path.dirname(path)} is being written by another save: {who}; its lock is {path}. "
            f"Only one save may write a checkpoint directory at a time: wait for that save to end, "
            f"or save into another directory. The lock is released when its holder exits, even "
            f"killed, so a lock that stays held means that process is still alive")


def _close_held_in_child() -> None:
    global _held_guard
    # The child shares the parent's open file descriptions: closing its copies keeps the
    # locks the parent's alone (they drop when the parent closes them or dies).
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()
    _held_guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _held_guard.acquire(), after_in_parent=lambda: _held_guard.release(),
                        after_in_child=_close_held_in_child)

"""Plain local files: positional and mapped reads, fsync, atomic rename, flock'd writer locks.

Example::

    store = LocalStorage()
    with store.atomic_writer("/ckpt/metadata.json") as f:
        f.write(b"{}")
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import threading
import weakref

from shardkit import knobs
from shardkit.errors import CheckpointIOError, MissingShardError
from shardkit.storage.backends.atomic import atomic_local_writer, fsync_dir, makedirs_synced, typed_io_errors
from shardkit.storage.backends.base import Reader, Storage
from shardkit.storage.backends.lock import is_lock_name, local_writer_lock
from shardkit.storage.fast_io.memcopy import buffer_address, copy_and_hash, copy_bytes
from shardkit.storage.fast_io.map_prefetch import advise_huge_pages, prefetch_mapped

__all__ = ["LocalStorage", "check_regular_file"]


class _LocalReader(Reader):
    """Positional reads of a local file; large ones copy from a read-only map of it.

    Reads of at least ``knobs.MMAP_READ_MIN_BYTES`` (with ``knobs.MMAP_READS``)
    copy straight from the page cache through a map of the file with
    ``storage.fast_io.memcopy.copy_bytes``: on the 2-core box a warm 2 GiB file
    came in 0.13-0.15 s this way against 0.21-0.26 s with ``preadv`` on the
    same two threads (the kernel's copy reads every destination line first).
    Each copied range's mappings are dropped right away (``MADV_DONTNEED``),
    so the pages count in the page cache but not in this process's RSS. The
    size is fixed at open: reads past it raise ``EOFError``, never touch the
    map. Like every mapped reader (safetensors, DCP), a file truncated in
    place by another program while it is being read stops the process with
    SIGBUS; shardkit itself only ever replaces files whole.
    """

    extra_reads_are_cheap = True

    def __init__(self, path: str):
        check_regular_file(path)
        # O_NONBLOCK: should a FIFO replace the file after the check, opening it still does not block.
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, st.st_mode)
        except BaseException:
            os.close(self._fd)
            raise
        super().__init__(path, st.st_size)
        self._fd_closer = weakref.finalize(self, os.close, self._fd)  # dropped without close(): freed with it
        self._map_lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._map_address: int | None = None  # None: not mapped yet; 0: cannot be mapped

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        if self._copies_from_map(offset, len(out)):
            copy_bytes(buffer_address(out), self._map_address + offset, len(out))
            self._unmap_pages(offset, len(out))
            return
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                raise self._short(offset, len(out), done)
            done += n

    def read_into_hashed(self, offset: int, out: memoryview, hasher) -> None:
        # Large reads copy out of the page-cache map and hash the same bytes
        # while they are hot (``memcopy.copy_and_hash``: one pass in C with the
        # extension's hasher), so the file's bytes cross the memory bus once
        # for both. Else read, then hash what was read.
        out = out.cast("B") if out.format != "B" else out
        if not self._copies_from_map(offset, len(out)):
            return super().read_into_hashed(offset, out, hasher)
        with memoryview(self._map) as whole:
            copy_and_hash(buffer_address(out), whole[offset:offset + len(out)], hasher)
        self._unmap_pages(offset, len(out))

    def hash_range(self, offset: int, nbytes: int, hasher) -> None:
        if not (knobs.MMAP_READS and 0 <= offset and offset + nbytes <= self.size_bytes and self._mapped_address()):
            return super().hash_range(offset, nbytes, hasher)
        with memoryview(self._map) as whole:  # straight from the page cache: no copy
            hasher.update(whole[offset:offset + nbytes])
        self._unmap_pages(offset, nbytes)

    def map_range(self, offset: int, nbytes: int, *, prefetch: bool = True) -> "memoryview | None":
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.size_bytes or self._fd < 0:
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            private = mmap.mmap(self._fd, offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        except (OSError, ValueError):  # not mappable: the caller reads instead
            return None
        advise_huge_pages(private)
        if prefetch:
            prefetch_mapped(private, [(offset - start, nbytes)])  # pages mapped in the background, ahead of use
        return memoryview(private)[offset - start:offset - start + nbytes]

    def _copies_from_map(self, offset: int, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` at ``offset`` copies from the page-cache map (large, inside the file, mappable)."""
        return (knobs.MMAP_READS and nbytes >= knobs.MMAP_READ_MIN_BYTES and 0 <= offset
                and offset + nbytes <= self.size_bytes
                and bool(self._mapped_address()))

    def _mapped_address(self) -> int:
        with self._map_lock:
            if self._map_address is None:
                self._map_address = 0
                try:
                    self._map = mmap.mmap(self._fd, self.size_bytes, access=mmap.ACCESS_READ)
                except (OSError, ValueError):  # not mappable (a pipe, a special file): read instead
                    self._map = None
                else:
                    self._map_address = buffer_address(self._map)
            return self._map_address

    def _unmap_pages(self, offset: int, length: int) -> None:
        # Drop this range's page-table entries once copied: the pages stay in the
        # page cache, but no longer count in this process's RSS, so a loading
        # rank's resident memory stays its output plus what it is copying now.
        # Safe beside other threads' reads of the same pages: a read-only file
        # map just faults them in again.
        start = offset - offset % mmap.PAGESIZE
        end = min(self.size_bytes, offset + length)
        if self._map is not None and end > start and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        with self._map_lock:
            self._map_address = 0
            if self._map is not None:
                self._map.close()
                self._map = None
        if self._fd >= 0:
            self._fd_closer.detach()
            os.close(self._fd)
            self._fd = -1


def check_regular_file(path: str) -> None:
    """Raise :class:`MissingShardError` unless ``path`` is a regular local file (checked without opening it).

    A FIFO, socket or device in place of a checkpoint file would block or
    stream forever, and a directory fails later with a raw ``IsADirectoryError``.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise MissingShardError(f"{path} does not exist") from e
    except NotADirectoryError as e:
        raise MissingShardError(f"{path} does not exist (a part of its path is not a directory)") from e
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def _not_regular(path: str, mode: int) -> MissingShardError:
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")
    return MissingShardError(f"{path} is {kind}, not a regular file, so it was not opened; a checkpoint file "
                             f"must be a plain file. Remove or replace it (or load an earlier checkpoint)")


class LocalStorage(Storage):
    """Plain local files, with fsync and atomic rename."""

    renames_directories = True
    has_symlinks = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size_bytes(self, path: str) -> int:
        return os.path.getsize(path)

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its missing parents, each new entry synced into its parent, so a
        checkpoint committed inside does not vanish with its directory on a power loss."""
        with typed_io_errors(path, "create the directory", "Nothing was written; every checkpoint already saved is untouched."):
            makedirs_synced(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def remove(self, path: str) -> None:
        with typed_io_errors(path, "remove", "Nothing was removed or written: every checkpoint already saved is untouched."):
            os.remove(path)
            fsync_dir(os.path.dirname(path) or ".")

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=not os.path.exists(path))

    def clear_directory(self, path: str) -> list[str]:
        removed = []
        try:
            names = sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in names:
            if is_lock_name(name):   # held by this writer: unlinking it would let a second one in
                continue
            entry = os.path.join(path, name)
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry)
            removed.append(entry)
        return removed

    def modified_time(self, path: str) -> float:
        return os.path.getmtime(path)

    def same_path(self, path: str) -> str:
        return os.path.realpath(path)

    def open_file(self, path: str):
        check_regular_file(path)
        try:
            return open(path, "rb")
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e

    def open_sink(self, f, durable: bool = True, checksum: bool = False, size_bytes: int | None = None,
                  inline: bool = False, mode=None):
        """``O_DIRECT`` for durable writes where the file system takes it (as ``mode`` says), else
        positional buffered writes from a few threads (``storage.fast_io.sinks``), or
        from the calling thread with ``inline``; a small file (``size_bytes``
        under ``knobs.SMALL_FILE_BYTES``) is written inline too, made durable
        by the publish's fsync."""
        from shardkit.storage.fast_io.write_mode import FOREGROUND
        from shardkit.storage.fast_io.sinks import local_sink

        return local_sink(f.fileno(), durable, checksum, size_bytes, inline, mode or FOREGROUND)

    def open_reader(self, path: str) -> Reader:
        try:
            return _LocalReader(path)
        except MissingShardError:
            raise
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e

    def atomic_writer(self, path: str, durable: bool = True):
        return atomic_local_writer(path, durable)

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = ""):
        return local_writer_lock(directory, slot=slot, holder=holder)

    def map_private(self, path: str) -> "mmap.mmap | None":
        """A copy-on-write map of the whole file (None when it is empty). The map holds one file
        descriptor until it is closed or collected: a process mapping more files than its
        descriptor limit gets a ``CheckpointIOError`` saying so."""
        check_regular_file(path)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return None  # an empty file cannot be mapped
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise CheckpointIOError(
                f"could not map {path}: too many open files ({errno.errorcode[e.errno]}). Each mapped file "
                f"holds one descriptor while any tensor loaded from it lives; raise the limit (ulimit -n), "
                f"drop tensors of earlier loads, or load with mmap=False (copies, no descriptor kept)",
                e.errno, e.strerror, path) from e
        advise_huge_pages(mapping)  # read through this map, the file is cached in large folios
        return mapping

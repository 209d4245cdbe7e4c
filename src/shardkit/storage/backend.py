"""Where bytes live: local paths and fsspec URLs behind one small interface.

:func:`storage_for` picks the backend from the path: plain paths (and
``file://``) go to :class:`LocalStorage`, which uses ``os`` calls directly
(positional reads, fsync, atomic rename); anything with another scheme
(``s3://``, ``memory://``, ...) goes to :class:`FsspecStorage`. Backends move
bytes only; they know nothing of tensors or checkpoints.

Example::

    store = storage_for("/ckpt/step-100")
    with store.atomic_writer(store.join("/ckpt/step-100", "metadata.json")) as f:
        f.write(b"{}")
    with store.open_reader(path) as r:
        r.read_into(offset=0, out=memoryview(buf))
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from typing import BinaryIO, Iterator

from shardkit import knobs
from shardkit.errors import MissingShardError
from shardkit.storage.atomic import atomic_local_writer, fsync_dir, typed_io_errors
from shardkit.storage.lock import local_writer_lock
from shardkit.storage.memcopy import buffer_address, copy_bytes

__all__ = ["BufferReader", "Reader", "Storage", "LocalStorage", "FsspecStorage", "storage_for", "check_regular_file"]


class Reader:
    """An open file that reads at explicit offsets (no shared seek position for local files)."""

    def __init__(self, name: str, size_bytes: int):
        self.name = name
        self.size_bytes = size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError

    def read_into_hashed(self, offset: int, out: memoryview, hasher) -> None:
        """Fill ``out`` from ``offset`` like :meth:`read_into`, feeding the same bytes to ``hasher`` (``.update``).

        The bytes are hashed while they are hot: the read goes in slices of
        ``knobs.HASH_SLICE_BYTES`` (cache-sized), each hashed right after it
        is read, on this thread -- never a second pass over ``out``.
        """
        out = out.cast("B") if out.format != "B" else out
        step = max(1, knobs.HASH_SLICE_BYTES)
        for start in range(0, len(out), step):
            piece = out[start:start + step]
            self.read_into(offset + start, piece)
            hasher.update(piece)

    def hash_range(self, offset: int, nbytes: int, hasher) -> None:
        """Feed ``nbytes`` of the file at ``offset`` to ``hasher`` without keeping them (a bounded scratch buffer)."""
        scratch = memoryview(bytearray(min(nbytes, max(1, knobs.HASH_SLICE_BYTES))))
        for start in range(0, nbytes, len(scratch) or 1):
            piece = scratch[:min(len(scratch), nbytes - start)]
            self.read_into(offset + start, piece)
            hasher.update(piece)

    def map_range(self, offset: int, nbytes: int) -> "memoryview | None":
        """``nbytes`` of the file at ``offset`` as a writable, copy-on-write map, or None where this reader cannot map.

        Nothing is read now (pages come from the page cache when touched);
        writes to the view stay private to this process and never reach the
        file. The view keeps its map alive (after :meth:`close` too). Only
        local files map; other readers return None and callers read instead.
        A file truncated in place while the view lives raises SIGBUS on access.
        """
        return None

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        pass

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _short(self, offset: int, wanted: int, got: int) -> EOFError:
        return EOFError(
            f"{self.name}: wanted {wanted} bytes at offset {offset}, the file ended after {got}; "
            f"it is truncated (size now {self.size_bytes} bytes)"
        )


class BufferReader(Reader):
    """A :class:`Reader` over bytes already in memory (e.g. a map of the file), named ``name``.

    Lets code that parses a file through a reader (``read_header``) parse a
    mapping without opening the file again. Reads past the end raise ``EOFError``.
    """

    def __init__(self, name: str, buffer):
        self._view = memoryview(buffer).cast("B")
        super().__init__(name, len(self._view))

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        got = max(0, min(len(out), self.size_bytes - offset))
        if got < len(out):
            raise self._short(offset, len(out), got)
        out[:] = self._view[offset:offset + len(out)]

    def close(self) -> None:
        self._view.release()


class _LocalReader(Reader):
    """Positional reads of a local file; large ones copy from a read-only map of it.

    Reads of at least ``knobs.MMAP_READ_MIN_BYTES`` (with ``knobs.MMAP_READS``)
    copy straight from the page cache through a map of the file with
    ``storage.memcopy.copy_bytes``: on the 2-core box a warm 2 GiB file
    came in 0.13-0.15 s this way against 0.21-0.26 s with ``preadv`` on the
    same two threads (the kernel's copy reads every destination line first).
    Each copied range's mappings are dropped right away (``MADV_DONTNEED``),
    so the pages count in the page cache but not in this process's RSS. The
    size is fixed at open: reads past it raise ``EOFError``, never touch the
    map. Like every mapped reader (safetensors, DCP), a file truncated in
    place by another program while it is being read stops the process with
    SIGBUS; shardkit itself only ever replaces files whole.
    """

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
        self._map_lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._map_address: int | None = None  # None: not mapped yet; 0: cannot be mapped

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        if knobs.MMAP_READS and len(out) >= knobs.MMAP_READ_MIN_BYTES and offset + len(out) <= self.size_bytes:
            base = self._mapped_address()
            if base:
                copy_bytes(buffer_address(out), base + offset, len(out))
                self._unmap_pages(offset, len(out))
                return
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                raise self._short(offset, len(out), done)
            done += n

    def read_into_hashed(self, offset: int, out: memoryview, hasher) -> None:
        # Large reads: hash each slice of the page-cache map (bringing it into
        # the cache), then copy the now-hot slice out: the file's bytes cross
        # the memory bus once for both. Else read, then hash what was read.
        out = out.cast("B") if out.format != "B" else out
        if not (knobs.MMAP_READS and len(out) >= knobs.MMAP_READ_MIN_BYTES
                and offset + len(out) <= self.size_bytes and self._mapped_address()):
            return super().read_into_hashed(offset, out, hasher)
        base, dst, step = self._map_address, buffer_address(out), max(1, knobs.HASH_SLICE_BYTES)
        with memoryview(self._map) as whole:
            for start in range(0, len(out), step):
                n = min(step, len(out) - start)
                hasher.update(whole[offset + start:offset + start + n])
                copy_bytes(dst + start, base + offset + start, n)
        self._unmap_pages(offset, len(out))

    def hash_range(self, offset: int, nbytes: int, hasher) -> None:
        if not (knobs.MMAP_READS and 0 <= offset and offset + nbytes <= self.size_bytes and self._mapped_address()):
            return super().hash_range(offset, nbytes, hasher)
        with memoryview(self._map) as whole:  # straight from the page cache: no copy
            hasher.update(whole[offset:offset + nbytes])
        self._unmap_pages(offset, nbytes)

    def map_range(self, offset: int, nbytes: int) -> "memoryview | None":
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.size_bytes or self._fd < 0:
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            private = mmap.mmap(self._fd, offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        except (OSError, ValueError):  # not mappable: the caller reads instead
            return None
        return memoryview(private)[offset - start:offset - start + nbytes]

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


class _FileObjReader(Reader):
    """Reader over a seekable file object (fsspec); not thread-safe, so it locks."""

    def __init__(self, name: str, fobj: BinaryIO, size_bytes: int):
        import threading

        super().__init__(name, size_bytes)
        self._f = fobj
        self._lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        with self._lock:
            self._f.seek(offset)
            done = 0
            while done < len(out):
                chunk = self._f.read(len(out) - done)
                if not chunk:
                    raise self._short(offset, len(out), done)
                out[done : done + len(chunk)] = chunk
                done += len(chunk)

    def close(self) -> None:
        self._f.close()


class Storage:
    """The operations shardkit needs from a place that holds files."""

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def size_bytes(self, path: str) -> int:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        """Base names of the entries directly inside ``path``."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def open_reader(self, path: str) -> Reader:
        raise NotImplementedError

    def atomic_writer(self, path: str, durable: bool = True) -> contextlib.AbstractContextManager[BinaryIO]:
        """A file that appears at ``path`` whole when the block exits cleanly, or not at all.

        ``durable``: also flushed to stable storage before it appears (local
        files: fsync of the file and its directory); where the store has no
        such step the flag changes nothing.
        """
        raise NotImplementedError

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = "") -> contextlib.AbstractContextManager:
        """Hold the exclusive writer lock ``slot`` of ``directory`` for a ``with`` block.

        Creates ``directory`` if needed. A second holder of the same slot
        fails at once with :class:`~shardkit.errors.CheckpointBusyError`,
        whose message names the first (pid, host, since when, ``holder``);
        it never waits. Slots are independent (a distributed save takes one
        per rank; slot 0 is the directory's main writer, also taken by HF
        saves). Local files: an ``flock``'d hidden file (see ``storage.lock``;
        :func:`~shardkit.storage.is_lock_name` names it) that the kernel
        releases when its holder dies. Stores without locks (fsspec, object
        stores) hold nothing: one writer per directory is then the caller's
        to ensure.

        Example::

            with store.writer_lock(root, holder="my export"):
                ...  # write the files of the checkpoint in root
        """
        raise NotImplementedError

    def map_private(self, path: str) -> "mmap.mmap | None":
        """A copy-on-write memory map of the whole file, or None where files cannot be mapped.

        Writes through the map never reach the file. Only local files can be
        mapped; remote storage returns None and callers read instead.
        """
        return None

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        """The whole file, refusing one larger than ``max_bytes``."""
        with self.open_reader(path) as r:
            if r.size_bytes > max_bytes:
                from shardkit.errors import MetadataError

                raise MetadataError(
                    f"{path} is {r.size_bytes} bytes, over the limit of {max_bytes} for this kind "
                    f"of file; it is not a file shardkit wrote, or it is corrupt"
                )
            return r.read(0, r.size_bytes)


class LocalStorage(Storage):
    """Plain local files, with fsync and atomic rename."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size_bytes(self, path: str) -> int:
        return os.path.getsize(path)

    def makedirs(self, path: str) -> None:
        with typed_io_errors(path, "create the directory", "Nothing was written; every checkpoint already saved is untouched."):
            os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def remove(self, path: str) -> None:
        with typed_io_errors(path, "remove", "Nothing was removed or written: every checkpoint already saved is untouched."):
            os.remove(path)
            fsync_dir(os.path.dirname(path) or ".")

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
        check_regular_file(path)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return None  # an empty file cannot be mapped
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e


class FsspecStorage(Storage):
    """Any fsspec filesystem. Atomicity is the store's own (object stores publish on close)."""

    def __init__(self, url: str):
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url)
        self._protocol = url.split("://", 1)[0]

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._strip(path))

    def size_bytes(self, path: str) -> int:
        return int(self.fs.size(self._strip(path)))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._strip(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._strip(path), detail=False))

    def remove(self, path: str) -> None:
        self.fs.rm(self._strip(path))

    def open_reader(self, path: str) -> Reader:
        stripped = self._strip(path)
        try:
            size = int(self.fs.size(stripped))
            return _FileObjReader(path, self.fs.open(stripped, "rb"), size)
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = ""):
        # No advisory locks on object stores, and a marker object would stay behind a
        # killed writer and block every later save: nothing is held here (documented
        # in Storage.writer_lock), only the directory is made, as the local lock does.
        self.makedirs(directory)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def atomic_writer(self, path: str, durable: bool = True) -> Iterator[BinaryIO]:
        # Object stores persist on close; ``durable`` changes nothing here.
        # Write under a temporary name, then move: on stores where mv is a copy,
        # readers still never see a half-written final name.
        tmp = self._strip(path) + ".tmp-shardkit"
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, self._strip(path))
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise


def storage_for(path: str | os.PathLike) -> tuple[Storage, str]:
    """The backend for ``path`` and the path as that backend spells it."""
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        return FsspecStorage(path), path
    if path.startswith("file://"):
        path = path[len("file://") :]
    return LocalStorage(), path

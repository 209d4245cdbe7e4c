"""The storage interface: :class:`Storage` (a place that holds files) and :class:`Reader` (an open file).

Backends implement it, one per file: ``storage.backends.local`` (plain files) and
``storage.backends.fsspec_store`` (any fsspec URL: object stores, memory). Callers
use only these methods and never test which backend they have;
:func:`shardkit.storage.storage_for` picks one from a path.

Example::

    store, root = storage_for("/ckpt/step-100")
    with store.atomic_writer(store.join(root, "metadata.json")) as f:
        f.write(b"{}")
"""

from __future__ import annotations

import contextlib
import mmap
from typing import BinaryIO

from shardkit import knobs

__all__ = ["BufferReader", "Reader", "Storage", "StreamSink"]


class Reader:
    """An open file that reads at explicit offsets (no shared seek position for local files).

    ``extra_reads_are_cheap`` says whether reading bytes nobody asked for costs
    little (local files, memory: True) or a download (object stores: False);
    verified reads use it to decide whether to fetch the rest of a checksum
    block a read covers only in part (``storage.safetensors_format.tensor_io.read_ranges``).
    """

    extra_reads_are_cheap = False

    def __init__(self, name: str, size_bytes: int):
        self.name = name
        self.size_bytes = size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError

    def read_into_views(self, offset: int, views: list[memoryview]) -> None:
        """Fill ``views`` one after the other from the file's bytes at ``offset`` (a gather read).

        The views tile one contiguous range of the file: the first gets the
        bytes at ``offset``, the next those right after it, and so on. Object
        stores fetch the whole range in as few requests as their part size
        allows (``fsspec_store``); the default reads each view on its own.
        Example: ``reader.read_into_views(0, [byte_view(a), byte_view(b)])``.
        """
        for view in views:
            self.read_into(offset, view)
            offset += view.nbytes

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

    def map_range(self, offset: int, nbytes: int, *, prefetch: bool = True) -> "memoryview | None":
        """``nbytes`` of the file at ``offset`` as a writable, copy-on-write map, or None where this reader cannot map.

        Nothing is read now (pages come from the page cache when touched, or
        earlier from the background read-ahead of ``storage.fast_io.map_prefetch``,
        unless ``prefetch=False``: a caller that populates each piece itself
        right before it reads it, on its own threads);
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

    def check_inside(self, offset: int, nbytes: int) -> None:
        """Raise ``EOFError`` unless the ``nbytes`` at ``offset`` all lie inside the file (reads nothing)."""
        if offset < 0:
            raise EOFError(f"{self.name}: wanted {nbytes} bytes at offset {offset}; file offsets start at 0")
        if offset + nbytes > self.size_bytes:
            raise self._short(offset, nbytes, max(0, self.size_bytes - offset))

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

    extra_reads_are_cheap = True

    def __init__(self, name: str, buffer):
        self._view = memoryview(buffer).cast("B")
        super().__init__(name, len(self._view))

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        self.check_inside(offset, len(out))
        out[:] = self._view[offset:offset + len(out)]

    def close(self) -> None:
        self._view.release()



class StreamSink:
    """Sequential writes to a file object: the write method of stores without a faster one.

    ``write`` takes every byte of ``piece`` before it returns (the caller may
    reuse the memory); ``drain`` and ``close`` have nothing left to wait for.
    """

    hasher = None  # writes the caller's memory itself: the source's hashes are the written bytes'

    def __init__(self, f):
        self._f = f

    def write(self, piece: memoryview) -> None:
        written = 0
        while written < len(piece):
            n = self._f.write(piece[written:])
            written += len(piece) - written if n is None else n

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class Storage:
    """The operations shardkit needs from a place that holds files.

    Paths are strings as the backend spells them (see ``storage_for``); a
    "directory" on an object store is a key prefix. Each backend picks its
    own way to move bytes (:meth:`open_sink`, :meth:`open_reader`), so
    callers never test which backend they have.
    """

    #: Whether a whole directory can be renamed into place in one step (local files);
    #: False where a "directory" is a key prefix (object stores): writers then build
    #: it under its final name, commit file last.
    renames_directories = False
    #: Whether the store keeps symbolic links (local files); object stores have none.
    has_symlinks = False

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

    def remove_files(self, paths: list[str]) -> None:
        """Delete each file of ``paths`` that exists; a missing one is not an error.

        What a save withdraws before it writes (an old commit file, a rank's
        manifest): object stores do it in one request, without asking first
        what is there. Not for directories. Example::

            store.remove_files([store.join(d, "metadata.json"), store.join(d, "rank_0.json")])
        """
        for path in paths:
            if self.exists(path):
                with contextlib.suppress(FileNotFoundError):
                    self.remove(path)  # another process got there first: the goal is reached

    def isdir(self, path: str) -> bool:
        """True if ``path`` is a directory (on an object store: a prefix that holds objects)."""
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; a missing ``path`` is not an error.

        On object stores that includes the incomplete multipart uploads under
        the prefix (a killed writer's, never visible but billed). It does not
        order the deletions: to withdraw a checkpoint, remove its commit file
        (``metadata.json``, an index) with :meth:`remove` first.
        """
        raise NotImplementedError

    def clear_directory(self, path: str) -> list[str]:
        """Delete everything inside ``path`` except its writer-lock files; return what was removed.

        For a writer that holds ``path``'s lock (:meth:`writer_lock`) and must
        empty it without letting a second writer in: removing a held lock file
        would. ``path`` itself stays; a missing ``path`` is not an error. On
        object stores the incomplete uploads under it go too (as
        :meth:`remove_tree`). Like :meth:`remove_tree` it does not order the
        deletions. Example::

            with store.writer_lock(step_dir):
                store.clear_directory(step_dir)   # a crashed save's leftovers
                ...                               # write the new checkpoint
        """
        raise NotImplementedError

    def modified_time(self, path: str) -> float:
        """When the file at ``path`` was last written, in seconds since the epoch."""
        raise NotImplementedError

    def same_path(self, path: str) -> str:
        """A spelling of ``path`` that compares equal for equal places (local: the real path)."""
        return path.rstrip("/")

    def open_file(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A seekable binary file object reading ``path``, for libraries that want one
        (``torch.load``, ``zipfile``). Prefer :meth:`open_reader` for byte ranges."""
        raise NotImplementedError

    def open_sink(self, f: BinaryIO, durable: bool = True, checksum: bool = False, size_bytes: int | None = None,
                  inline: bool = False, mode=None):
        """The fastest way this store takes a file's bytes in order, given the file
        object :meth:`atomic_writer` yielded: an object with ``write(piece)``,
        ``drain()`` (wait for what was handed over), ``close()`` and ``hasher``.

        ``size_bytes``, the file's final size where the caller knows it, lets
        a backend write a small file more simply (the local one writes files
        under ``knobs.SMALL_FILE_BYTES`` inline: no threads, no ``O_DIRECT``).
        ``inline`` says the caller has nothing to do between pieces (every
        tensor is plain CPU memory): a backend that would hand buffered writes
        to a thread may make them in the caller's thread instead (the local
        one does: a thread then only adds hand-offs). ``mode`` (a
        ``fast_io.write_mode.WriteMode``; None: a blocking save's) tells a backend
        that can write past the page cache (the local one, ``O_DIRECT``) whether
        to, and at what pace; S3 uploads take the pace too; the others ignore it.

        A sink may also have ``piece_bytes``: the size of the pieces it takes
        best (an object store's part size); without it writers hand over
        ``knobs.IO_CHUNK_BYTES`` at a time. A piece's memory must stay
        unchanged until ``drain()`` (sinks may send it later, without a copy).

        ``hasher`` is a ``BlockHasher`` of the bytes the sink wrote from its own
        buffers when ``checksum`` is asked and the sink copies (the local
        ``O_DIRECT`` sink), so the writer records what reached the file; None
        when the sink writes the caller's memory itself.

        The default writes to ``f`` in sequence (:class:`StreamSink`); the local
        backend writes positionally or with ``O_DIRECT``, object stores upload
        parts in parallel behind ``f`` itself.

        Example::

            with store.atomic_writer(path) as f:
                sink = store.open_sink(f)
                try:
                    sink.write(memoryview(data))
                finally:
                    sink.close()
        """
        return StreamSink(f)

    def remove_orphans(self, directory: str, *, uploads_of=None) -> list[str]:
        """Delete what killed writers left in ``directory``; return what was removed.

        Leftovers are files (and directories) under a temporary name
        (``storage.is_temp_name``) directly in ``directory`` and, on object
        stores, multipart uploads never completed anywhere under it (invisible
        to readers, but billed). None of them ever makes a checkpoint look
        complete; this only reclaims space. Call it only when no save into
        ``directory`` is running: a running save's files look the same.

        ``uploads_of``: where ``directory`` is shared (a bucket's root, a
        prefix other jobs write under), a test of the name of the entry
        directly in ``directory`` that an upload lies under; only uploads it
        accepts are aborted (``lambda name: name.startswith("step-")``), so
        another writer's upload in flight stays. None: every upload.
        """
        from shardkit.storage.backends.atomic import is_temp_name

        if not self.isdir(directory):
            return []
        removed = [self.join(directory, n) for n in self.listdir(directory) if is_temp_name(n)]
        for path in removed:
            if self.isdir(path):   # a directory built under a temporary name
                self.remove_tree(path)
            else:
                self.remove(path)
        return removed

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
        saves). Local files: an ``flock``'d hidden file (see ``storage.backends.lock``;
        :func:`~shardkit.storage.is_lock_name` names it) that the kernel
        releases when its holder dies.

        What it does not do: on fsspec stores (``s3://``, ``gs://``,
        ``memory://``...) it holds **nothing** and detects nothing. Object
        stores have no ``flock``; a lease object would outlive a killed
        writer and block every later save until it expired, and would need a
        heartbeat and conditional overwrites to be safe. Two writers saving
        into one URL at once are then not detected: the last ``metadata.json``
        wins and may name data objects the other writer replaced, which
        ``validate`` (checksums) reports. One writer per URL is the caller's
        to ensure (one job per run directory; rank 0 alone commits).

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

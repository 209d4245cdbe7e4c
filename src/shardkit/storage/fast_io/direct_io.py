"""Durable local writes that bypass the page cache (Linux ``O_DIRECT``).

A durable save must reach the disk before it is published, so passing its
bytes through the page cache buys nothing: it costs a copy into freshly
allocated cache pages, dirty-page throttling and writeback, and it evicts
pages the training job still wants (its data, its code). Here the bytes are
copied into a few aligned bounce buffers of ``knobs.DIRECT_IO_BLOCK_BYTES``
and written with ``O_DIRECT`` by ``knobs.DIRECT_IO_QUEUE_DEPTH`` threads, so
the disk always has that many large requests queued. The last block is
padded to the alignment and the file truncated to its true size.

Measured on the 2-core benchmark VM (2 GiB, fsync'd): 1.1-1.5 s every run,
where buffered writes took 0.9-1.2 s in a quiet minute and 4-8 s when the
host had reclaimed the guest's free memory (fresh page-cache pages then
fault in from the host) -- the common case between two saves.

The copying, hashing and writing run in the extension's ``DirectWriter``
(``_direct_writer.c``): one call per run of pieces with the GIL released,
writes from native threads, so a background save leaves a training thread
the GIL (the Python version of this loop took it back hundreds of times per
300 MB, and training steps ran ~30% slower while a save was in flight).
Without the extension there is no direct path: writes are buffered.

Given a ``BlockHasher``, the sink hashes the source bytes as it copies them
(one pass) and each bounce buffer's bytes once written, before the buffer
is reused: the writer compares the two records, so memory changed between
the copy and the write fails the save, and the record describes the bytes
handed to ``pwrite``. The buffers are private memory
(``MAP_PRIVATE``), and a forked child starts with an empty pool, so two
processes never write through the same buffer (a shared one once let
concurrent saves in forked ranks commit each other's bytes). Where
``os.pwrite`` has been replaced (a tracer, a fault injector) every write
goes through the replacement instead of the system call.

What it does not do: it does not open, fsync or rename files (the caller
does: ``fast_io.sinks`` and ``backends.atomic``), and it is only for local
files. Where the file system refuses ``O_DIRECT`` (``EINVAL`` when the
flag is set or at a write) the same fd falls back to buffered writes with
early writeback, so a file is never lost to a missing feature.

Example::

    sink = open_direct_sink(fd, BlockHasher(8 << 20))      # None: use buffered writes
    sink.write_many([memoryview(header), byte_view(tensor)]); sink.close()
    sink.hasher.finish()     # the FileRecord of the bytes written (sink.source_record(): of the source's)
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import posix
import threading

from shardkit import knobs
from shardkit.storage.checksum import BlockHasher, FileRecord, combine_block_digests
from shardkit.storage.fast_io.memcopy import buffer_address
from shardkit.storage.fast_io.write_mode import FOREGROUND, Pace, WriteMode

try:
    from shardkit._stream_copy import DirectWriter
except ImportError:  # built without a C compiler: buffered writes only
    DirectWriter = None

__all__ = ["DirectSink", "open_direct_sink", "ALIGN_BYTES"]

#: File offsets, lengths and memory addresses of direct writes are multiples of this.
#: 4 KiB covers the logical block size of every disk and file system Linux
#: ships with (statx's dio alignment is not available from Python 3.11).
ALIGN_BYTES = 4096


def open_direct_sink(fd: int, hasher: BlockHasher | None = None, *, mode: WriteMode = FOREGROUND
                     ) -> "DirectSink | None":
    """Turn on ``O_DIRECT`` for ``fd`` and return a sink for it; None where that is not possible.

    ``hasher`` (optional) is fed the bytes written, in file order. ``mode.o_direct=False``: the same
    writer (its copy, hashing and writes in C, the GIL released) through the page cache;
    ``mode.pace``: its pace (see :class:`Pace`).
    """
    if not knobs.DIRECT_IO or not hasattr(os, "O_DIRECT") or DirectWriter is None:
        return None
    if not mode.o_direct:
        return DirectSink(fd, hasher, pace=mode.pace)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return None  # e.g. a file system without direct I/O
    return DirectSink(fd, hasher, pace=mode.pace)


class _Bounce:
    """One page-aligned anonymous buffer (an ``mmap``), touched once when made.

    Private (``MAP_PRIVATE``): Python's default for ``mmap.mmap(-1, n)`` is
    ``MAP_SHARED``, which a forked child would share with its parent.
    """

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self.map)
        self.addr = buffer_address(self.view)
        ctypes.memset(self.addr, 0, nbytes)  # fault it in now, not during a save

    @property
    def nbytes(self) -> int:
        return len(self.view)


class _BouncePool:
    """Buffers kept between files, so a save does not fault in fresh memory each time."""

    def __init__(self):
        self._free: list[_Bounce] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> _Bounce:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if buf.nbytes == nbytes:
                    return buf
        return _Bounce(nbytes)

    def give(self, buf: _Bounce) -> None:
        with self._lock:
            if len(self._free) < knobs.DIRECT_IO_QUEUE_DEPTH + 1:
                self._free.append(buf)


_POOL = _BouncePool()


def _fresh_pool_in_child() -> None:
    # The parent's buffers (and a lock another thread may hold at the fork) stay
    # the parent's: the child allocates its own.
    global _POOL
    _POOL = _BouncePool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_pool_in_child)


class DirectSink:
    """Sequential bytes in, aligned ``O_DIRECT`` positional writes out; ``close()`` sets the size.

    A façade over the extension's ``DirectWriter``: ``write``/``write_many``
    copy the pieces into the bounce buffers (hashing them in the same pass
    with a ``hasher``), one C call with the GIL released, and return once
    the caller's memory is free; ``DIRECT_IO_QUEUE_DEPTH`` native threads
    write full buffers while the next ones fill. With a ``hasher``, each
    written buffer's bytes are hashed again before it is reused: the
    records of the source bytes (:meth:`source_record`) and of the written
    ones (``hasher.finish()``) are compared by the caller. A ``pace`` (:class:`Pace`)
    sets its speed until the pace is lifted.
    """

    def __init__(self, fd: int, hasher: BlockHasher | None = None, *, pace: Pace | None = None):
        self._fd = fd
        self._block_bytes = max(ALIGN_BYTES, knobs.DIRECT_IO_BLOCK_BYTES // ALIGN_BYTES * ALIGN_BYTES)
        self._buffers = [_POOL.take(self._block_bytes) for _ in range(max(1, knobs.DIRECT_IO_QUEUE_DEPTH))]
        self._hash_bytes = hasher.block_bytes if hasher is not None else 0
        self._engine = DirectWriter(fd, [b.addr for b in self._buffers], self._block_bytes, self._hash_bytes,
                                    None if os.pwrite is posix.pwrite else os.pwrite,
                                    1.0 if pace is None else pace.share)
        self._pace = pace
        if pace is not None and pace.join(self._engine) == 1.0:
            self._engine.hurry()  # lifted between reading the share and joining
        self._written: tuple[int, list[str], list[str]] | None = None
        self.hasher = _Digests(self._hash_bytes, 2) if hasher is not None else None
        self.hashes_source = hasher is not None  # the writer need not hash the pieces itself

    def write(self, piece: memoryview) -> None:
        self.write_many([piece])

    def write_many(self, pieces: list[memoryview]) -> None:
        """Copy ``pieces`` in order (one call, GIL released); their memory is free when this returns."""
        self._engine.write([(buffer_address(p), p.nbytes) for p in pieces if p.nbytes])

    def drain(self) -> None:
        """Wait for the writes in flight (the bytes of every ``write`` so far are already copied)."""
        self._engine.drain()

    def close(self) -> None:
        """Write the last, padded block, wait for every write, truncate to the bytes written."""
        try:
            written = self._engine.finish()
            if written is not None:
                os.ftruncate(self._fd, written[0])
                self._written = written
                if self.hasher is not None:
                    self.hasher.done = written
        finally:
            if self._pace is not None:
                self._pace.leave(self._engine)
            self._engine.abort()
            for buf in self._buffers:
                _POOL.give(buf)
            self._buffers = []

    def source_record(self) -> FileRecord:
        """The record of the bytes the pieces held when they were copied (after :meth:`close`)."""
        return _Digests(self._hash_bytes, 1, self._written).finish()


class _Digests:
    """``finish()`` gives the :class:`FileRecord` of one list of the engine's digests (``which``: 1 the
    source's, 2 the written bytes'), once ``done`` holds ``finish()``'s result."""

    def __init__(self, block_bytes: int, which: int, done=None):
        self.block_bytes, self._which, self.done = block_bytes, which, done

    def finish(self) -> FileRecord:
        if self.done is None:
            raise RuntimeError("the direct sink was not closed, or its writes failed")
        digests = list(self.done[self._which])
        return FileRecord(self.done[0], combine_block_digests(digests), self.block_bytes, digests)

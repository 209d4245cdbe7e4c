"""Sinks for local files: where a writer's bytes go on their way to disk (``LocalStorage.open_sink``).

``O_DIRECT`` (``direct_io``) for durable writes where the file system takes it, else positional
buffered writes from a few threads, each chunk's writeback started at once. Not here: what is
written (the safetensors writer decides that) or where the file is published (``backends.local``).

Example::

    sink = local_sink(fd, durable=True, checksum=True, size_bytes=n)
    sink.write(memoryview(data)); sink.close()
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future, ThreadPoolExecutor

from shardkit import knobs
from shardkit.storage.backends.atomic import start_writeback
from shardkit.storage.checksum import BlockHasher
from shardkit.storage.fast_io.direct_io import open_direct_sink
from shardkit.storage.fast_io.write_mode import FOREGROUND, WriteMode

__all__ = ["local_sink", "PositionalSink"]


def local_sink(fd: int, durable: bool, checksum: bool = False, size_bytes: int | None = None,
                inline: bool = False, mode: WriteMode = FOREGROUND):
    """Direct I/O for durable writes where the file system takes it (hashing the bytes it writes
    when ``checksum``; written and paced as ``mode`` says), else positional
    buffered writes (``LocalStorage.open_sink``); a file
    known to be under ``knobs.SMALL_FILE_BYTES`` is written inline (the publish's fsync makes it
    durable), and so are buffered writes when ``inline`` says the caller has nothing to overlap."""
    if size_bytes is not None and size_bytes < knobs.SMALL_FILE_BYTES:
        return PositionalSink(fd, start_writeback=False, threads=0)
    hasher = BlockHasher(knobs.CHECKSUM_BLOCK_BYTES) if checksum else None
    direct = open_direct_sink(fd, hasher, mode=mode) if durable else None
    return direct if direct is not None else PositionalSink(fd, durable, threads=0 if inline else None)


class PositionalSink:
    """Positional writes from a thread pool, each chunk's writeback started at once.

    At most about ``2 * WRITE_THREADS`` chunks are in flight, so a lazy tensor's
    memory is released soon after its bytes are written. ``threads=0`` writes
    each piece inline, in the caller's thread.
    """

    hasher = None  # writes the caller's memory itself: the source's hashes are the written bytes'

    def __init__(self, fd: int, start_writeback: bool = True, threads: int | None = None):
        self._fd, self._offset, self._writeback = fd, 0, start_writeback
        self._threads = max(1, knobs.WRITE_THREADS) if threads is None else threads
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="shardkit-write") if self._threads else None
        self._pending: collections.deque[Future] = collections.deque()

    def write(self, piece: memoryview) -> None:
        if self._pool is None:
            self._pwrite(piece, self._offset)
            self._offset += len(piece)
            return
        while len(self._pending) >= 2 * self._threads:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._pwrite, piece, self._offset))
        self._offset += len(piece)

    def _pwrite(self, piece: memoryview, offset: int) -> None:
        done = 0
        while done < len(piece):
            done += os.pwrite(self._fd, piece[done:], offset + done)
        if self._writeback:
            start_writeback(self._fd, offset, len(piece))

    def drain(self) -> None:
        """Wait until every write handed over so far is done."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

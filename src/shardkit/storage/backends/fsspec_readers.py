"""Reads from an fsspec filesystem: ranged reads of one object, and the files ``open_file`` returns.

Split from ``fsspec_store`` (which builds these for ``FsspecStorage``). Reads
fetch exactly the byte ranges asked for (ranged GETs, split into
``knobs.OBJECT_PART_BYTES`` parts fetched concurrently; adjacent buffers of a
gather read are one range), never a whole object or a read-ahead block:
:func:`fetched_bytes` counts them. On S3 the bodies stream straight into the
caller's buffers. The client's failures are raised typed (``store_errors``).
Nothing here writes.

Example::

    reader = RangeReader("memory://ck/rank_0.safetensors", fs, "/ck/rank_0.safetensors", size)
    reader.read_into(0, memoryview(bytearray(8)))
"""

from __future__ import annotations

import asyncio
import errno
import threading

from shardkit import knobs
from shardkit.errors import CheckpointIOError
from shardkit.storage.backends.base import Reader
from shardkit.storage.backends.store_errors import store_errors

__all__ = ["fetched_bytes", "RangeReader", "S3RangeReader", "StoreFile"]

_fetched_lock = threading.Lock()
_fetched = [0]


def fetched_bytes() -> int:
    """Bytes this process has fetched through :class:`FsspecStorage` readers so far.

    A diagnostic (tests count what a resharding rank downloads). Example::

        before = fetched_bytes(); load_distributed(...); print(fetched_bytes() - before)
    """
    with _fetched_lock:
        return _fetched[0]


def _count_fetched(n: int) -> None:
    with _fetched_lock:
        _fetched[0] += n


def _parts(offset: int, views: list[memoryview], part_bytes: int) -> list[tuple[int, list[memoryview]]]:
    """Cut the range the (byte) ``views`` tile from ``offset`` into parts of ``part_bytes``: ``(start, views)`` each."""
    parts: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    start = filled = offset
    for view in views:
        taken = 0
        while taken < len(view):
            piece = view[taken : taken + part_bytes - (filled - start)]
            current.append(piece)
            taken += len(piece)
            filled += len(piece)
            if filled - start == part_bytes:
                parts.append((start, current))
                current, start = [], filled
    if current:
        parts.append((start, current))
    return parts


class RangeReader(Reader):
    """Ranged reads of one object; large reads are split into parts fetched concurrently.

    Thread-safe: no shared file position, each read is its own request(s).
    A gather read (:meth:`read_into_views`) of adjacent buffers is one range:
    one request per ``knobs.OBJECT_PART_BYTES``, however many buffers.
    """

    def __init__(self, name: str, fs, key: str, size_bytes: int):
        super().__init__(name, size_bytes)
        self._fs, self._key = fs, key

    def read_into(self, offset: int, out: memoryview) -> None:
        self.read_into_views(offset, [out])

    def read_into_views(self, offset: int, views: list[memoryview]) -> None:
        views = [v.cast("B") if v.format != "B" else v for v in views if v.nbytes]
        wanted = sum(len(v) for v in views)
        if wanted == 0:
            return
        self.check_inside(offset, wanted)
        parts = _parts(offset, views, max(1, knobs.OBJECT_PART_BYTES))
        with store_errors(self.name, "read"):
            got = self._fetch(parts)
        if got != wanted:
            raise self._short(offset, wanted, got)
        _count_fetched(got)

    def _fetch(self, parts: list[tuple[int, list[memoryview]]]) -> int:
        """Fill every part's views from the object; the bytes received (short if it ended early)."""
        ends = [start + sum(len(v) for v in views) for start, views in parts]
        if len(parts) == 1:
            pieces = [self._fs.cat_file(self._key, start=parts[0][0], end=ends[0])]
        else:
            pieces = self._fs.cat_ranges([self._key] * len(parts), [p[0] for p in parts], ends, on_error="raise")
        got = 0
        for (start, views), piece, stop in zip(parts, pieces, ends):
            if isinstance(piece, BaseException):
                raise piece
            piece = memoryview(piece).cast("B")
            if len(piece) > stop - start:  # the store sent more than the range: it ignored the range
                raise self._range_refused(start, stop, f"{len(piece)} bytes")
            position = 0
            for view in views:
                n = min(len(view), len(piece) - position)
                view[:n] = piece[position : position + n]
                position += n
            got += position
            if position != sum(len(v) for v in views):
                break
        return got


    def _range_refused(self, start: int, stop: int, answered: str) -> CheckpointIOError:
        """The error for a response that is not the byte range asked for: its bytes are never used."""
        return CheckpointIOError(
            f"{self.name}: asked the object store for bytes {start}-{stop - 1} of {self.size_bytes}, it answered "
            f"{answered}. Either the object changed since it was opened (another writer replaced it: load "
            f"again once that save is done), or the server or a proxy in between does not honour HTTP range "
            f"requests, which loading a checkpoint in parts needs (S3, MinIO and SeaweedFS do). Nothing was "
            f"loaded from that response.", errno.EIO, "byte range not honoured", self.name)


class S3RangeReader(RangeReader):
    """An S3 object's ranged GETs streamed straight into the caller's buffers.

    Each response body is copied chunk by chunk into the views as it
    arrives, on fsspec's event loop: no whole-range ``bytes`` is built and
    copied again. Up to ``knobs.OBJECT_PARTS_IN_FLIGHT`` parts of one read
    are fetched at once.
    """

    def __init__(self, name: str, fs, key: str, size_bytes: int):
        super().__init__(name, fs, key, size_bytes)
        self._bucket, self._object_key, _ = fs.split_path(key)

    def _fetch(self, parts: list[tuple[int, list[memoryview]]]) -> int:
        from fsspec.asyn import sync

        return sync(self._fs.loop, self._fetch_all, parts)

    async def _fetch_all(self, parts: list[tuple[int, list[memoryview]]]) -> int:
        gate = asyncio.Semaphore(max(1, knobs.OBJECT_PARTS_IN_FLIGHT))

        async def one(start: int, views: list[memoryview]) -> int:
            async with gate:
                return await self._get_into(start, views)

        # Every part is waited for, so none still writes into a buffer after a failure is raised.
        results = await asyncio.gather(*(one(start, views) for start, views in parts), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return sum(results)

    async def _get_into(self, start: int, views: list[memoryview]) -> int:
        stop = start + sum(len(v) for v in views)
        resp = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._object_key,
                                       Range=f"bytes={start}-{stop - 1}")
        body, got = resp["Body"], 0
        answered = resp.get("ContentRange")
        if answered != f"bytes {start}-{stop - 1}/{self.size_bytes}":
            body.close()
            raise self._range_refused(start, stop, repr(answered) if answered else "the whole object (no Content-Range)")
        try:
            for view in views:
                filled = 0
                while filled < len(view):
                    chunk = await body.read(len(view) - filled)
                    if not chunk:
                        return got + filled
                    view[filled : filled + len(chunk)] = chunk
                    filled += len(chunk)
                got += filled
        finally:
            body.close()
        return got


class StoreFile:
    """A file ``FsspecStorage.open_file`` opened: its reads raise the store's failures typed
    (``store_errors``); every other attribute is the fsspec file's own."""

    def __init__(self, f, url: str):
        self._f, self._url = f, url

    def read(self, *args):
        with store_errors(self._url, "read"):
            return self._f.read(*args)

    def readinto(self, buffer):
        with store_errors(self._url, "read"):
            return self._f.readinto(buffer)

    def readline(self, *args):
        with store_errors(self._url, "read"):
            return self._f.readline(*args)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

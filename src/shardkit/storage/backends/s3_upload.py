"""S3 multipart uploads sent from the caller's memory: the write path of ``FsspecStorage`` on ``s3://``.

A file becomes one object when :meth:`S3MultipartWriter.commit` completes
(nothing is visible under its key before; :meth:`~S3MultipartWriter.abort`
drops the parts). Through :class:`S3PartSink` the writer's pieces go out as
parts without a copy: a botocore body over the tensors' memory
(:class:`_ViewBody`), whose CRC-32 is computed on the part's thread, off
the event loop, and sent without an ``Expect: 100-continue`` round trip.
Only runs of small pieces (under S3's 5 MiB minimum part) are joined. A
file smaller than a part is one PUT. This module does not sign requests or
choose credentials (botocore does, as configured) and reads nothing.

Example::

    f = S3MultipartWriter(fs, "bucket/ckpt/rank_0.safetensors")
    sink = S3PartSink(f)
    sink.write(memoryview(data)); sink.drain(); f.commit()
"""

from __future__ import annotations

import base64
import contextlib
import io
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from shardkit import knobs
from shardkit.errors import CheckpointIOError
from shardkit.storage.backends.store_errors import store_errors

__all__ = ["NOTHING_PUBLISHED", "S3MultipartWriter", "S3PartSink"]

#: What a failed upload leaves.
NOTHING_PUBLISHED = ("Nothing was published under that name: the object there before (if any) and every "
                     "checkpoint already saved are untouched.")

#: S3's smallest part (all but the last part of an upload must be at least this big).
_MIN_PART_BYTES = 5 * 1024 * 1024
#: S3's limits: parts per upload, bytes per part, bytes per object.
_MAX_PARTS = 10_000
_MAX_PART_BYTES = 5 * 1024**3
_MAX_OBJECT_BYTES = 5 * 1024**4
#: A file of unknown size: parts double every this many (up to ``_MAX_PART_BYTES``), so
#: 16 MiB parts reach S3's 5 TiB object within its 10,000 parts.
_PARTS_PER_SIZE = 1000


def _crc32_header(body) -> str:
    """The ``x-amz-checksum-crc32`` value of ``body`` (base64 of the big-endian CRC-32), as botocore computes it."""
    return base64.b64encode((zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "big")).decode()


class _ViewBody:
    """A read-only, seekable file over a memoryview whose reads are slices of it (no copy).

    The body of an upload sent from the caller's memory: botocore takes a
    file object (it refuses a memoryview), reads it once to sign it and
    rewinds it for a retry. aiohttp sends it as an async iterable of
    ``_BODY_CHUNK_BYTES`` slices on the event loop (a plain file would be read
    in 256 KiB pieces on executor threads: a thread hop and a copy each).
    Not an ``io.IOBase`` on purpose: aiohttp would take it for a file. Example::

        body = _ViewBody(memoryview(b"abc")); bytes(body.read(2))   # b'ab'
    """

    def __init__(self, view: memoryview):
        self._view, self._position = view, 0

    def __len__(self) -> int:
        return len(self._view) - self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = min(max(0, base + offset), len(self._view))
        return self._position

    def read(self, size: int = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._position + size)
        piece = self._view[self._position:end]
        self._position = end
        return piece

    async def __aiter__(self):
        while self._position < len(self._view):
            yield self.read(_BODY_CHUNK_BYTES)


#: The slices an upload body is handed to the socket in.
_BODY_CHUNK_BYTES = 1024 * 1024


def _drop_expect_continue(params, **_) -> None:
    # botocore asks for ``100-continue`` before every upload body: a round trip more per part
    # (the server must answer before a byte is sent), for a body that is already in memory.
    if isinstance(params.get("body"), _ViewBody):
        params["headers"].pop("Expect", None)


def _send_without_expect_continue(fs) -> None:
    """Make ``fs``'s client send :class:`_ViewBody` bodies at once, without ``Expect: 100-continue``
    (its other requests are untouched). Idempotent."""
    # Last of the generic handlers: botocore's own add_expect_header is one of them.
    fs.s3.meta.events.register_last("before-call.s3", _drop_expect_continue, unique_id="shardkit-no-expect")


class S3MultipartWriter:
    """A write-only file whose bytes become one S3 object when :meth:`commit` completes.

    :meth:`write` copies (file semantics: the caller may reuse its buffer);
    :meth:`write_view` (the sink's path, :class:`S3PartSink`) keeps the
    caller's memory and sends it as it is: a part that lies in one view goes
    out without a copy, only views smaller than the smallest part (S3's
    5 MiB) are joined (with the start of the next view: under two smallest
    parts copied per run of small views). Parts are about
    ``knobs.OBJECT_PART_BYTES``; ``knobs.OBJECT_UPLOAD_PARTS_IN_FLIGHT`` in
    flight. Where S3's 10,000 parts could not hold the file, parts (and the
    smallest part) grow: to fit the size :meth:`expect_bytes` was told, or,
    with no size told, doubling every 1000 parts. A file smaller than
    one part is one PUT at commit. Each part's
    CRC-32 is computed on the part's thread (the server checks it), off the
    event loop. Nothing is visible under the key before
    ``complete_multipart_upload``; :meth:`abort` drops the parts. With a
    ``pace`` (a background save's ``fast_io.write_mode.Pace``, set by
    ``FsspecStorage.open_sink``) below full speed, one part is in flight at a
    time and its thread rests after it (:meth:`Pace.rest_after`), so the
    upload keeps the network and the CPU busy that share of the time only.
    """

    def __init__(self, fs, key: str):
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(key)
        self._floor_bytes = _MIN_PART_BYTES  # every part but the last is at least this big
        self._part_bytes = max(_MIN_PART_BYTES, knobs.OBJECT_PART_BYTES)
        self._pending: list[memoryview] = []   # not yet a part: joined when sent
        self._pending_bytes = 0
        self._ready: list[list[memoryview]] = []  # parts held back until the file is known to need an upload
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._in_flight: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self._written = 0
        self.pace = None   # a Pace: a background save's uploads rest between parts (see the class docstring)

    def expect_bytes(self, size_bytes: int | None) -> None:
        """Size the parts for a file of ``size_bytes`` (before its first byte): S3 takes at most
        10,000 parts of one upload; a file over S3's 5 TiB limit is refused here, before any upload."""
        if size_bytes is None or self._written:
            return
        if size_bytes > _MAX_OBJECT_BYTES:
            raise CheckpointIOError(
                f"s3://{self._bucket}/{self._key} would be {size_bytes} bytes, over S3's limit of 5 TiB per "
                f"object. Nothing was uploaded; save with more ranks (or more files per rank) so each file is smaller.")
        # every part but the last >= floor: at most size / floor + 1 parts
        self._floor_bytes = max(self._floor_bytes, -(-size_bytes // (_MAX_PARTS - 1)))
        self._part_bytes = max(self._part_bytes, self._floor_bytes)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.write_view(memoryview(view.tobytes()))
        return len(view)

    def write_view(self, view: memoryview) -> None:
        """Take ``view`` without copying it: its memory must stay as it is until :meth:`wait_sent` or commit."""
        view = view.cast("B") if view.format != "B" else view
        self._written += len(view)
        while len(view):
            floor = self._floor_bytes
            if self._pending_bytes == 0 and len(view) >= floor:
                take = len(view) if len(view) < self._part_bytes + floor else self._part_bytes
                self._add_part([view[:take]])
            else:  # small bytes wait for more, topped up to the smallest part from the next view
                need = floor - self._pending_bytes  # > 0
                # ... leaving of that view nothing or a part of its own: under 2 smallest parts copied
                take = len(view) if len(view) - need < floor else need
                self._pending.append(view[:take])
                self._pending_bytes += take
                if self._pending_bytes >= floor:
                    self._add_part(self._pending)
                    self._pending, self._pending_bytes = [], 0
            view = view[take:]

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass

    def wait_sent(self) -> None:
        """Wait until every part handed over so far is uploaded (views before are free after)."""
        for f in self._parts:
            f.result()

    def _add_part(self, views: list[memoryview]) -> None:
        self._ready.append(views)
        if self._upload_id is None and self._written < self._part_bytes:
            return  # may still be a small file: one PUT at commit
        for ready in self._ready:
            self._send_part(ready)
        self._ready = []

    def _send_part(self, views: list[memoryview]) -> None:
        in_flight = max(1, knobs.OBJECT_UPLOAD_PARTS_IN_FLIGHT)
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", Bucket=self._bucket, Key=self._key)["UploadId"]
            self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="shardkit-s3-part")
        if self.pace is not None and self.pace.share < 1.0:
            in_flight = 1   # paced: one part at a time, each followed by its rest
        self._in_flight = [f for f in self._in_flight if not f.done()]
        while len(self._in_flight) >= in_flight:
            for done in wait(self._in_flight, return_when=FIRST_COMPLETED).done:
                done.result()  # a failed part stops the upload here
            self._in_flight = [f for f in self._in_flight if not f.done()]
        if len(self._parts) >= _MAX_PARTS:
            raise CheckpointIOError(
                f"s3://{self._bucket}/{self._key} needs more than S3's {_MAX_PARTS} parts of one upload; "
                f"nothing was published under that key. Raise knobs.OBJECT_PART_BYTES, or save with more ranks.")
        body = views[0] if len(views) == 1 else memoryview(b"".join(views))  # one view: no copy
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, body))
        self._in_flight.append(self._parts[-1])
        if len(self._parts) % _PARTS_PER_SIZE == 0:  # a file larger than expected still fits
            self._floor_bytes = min(2 * self._floor_bytes, _MAX_PART_BYTES // 4)
            self._part_bytes = min(max(2 * self._part_bytes, self._floor_bytes), _MAX_PART_BYTES // 2)

    def _upload_part(self, number: int, body: memoryview) -> dict:
        _send_without_expect_continue(self._fs)
        start_s = time.monotonic()
        out = self._call("upload_part", Bucket=self._bucket, Key=self._key, PartNumber=number,
                         UploadId=self._upload_id, Body=_ViewBody(body), ChecksumCRC32=_crc32_header(body))
        if self.pace is not None:
            self.pace.rest_after(time.monotonic() - start_s)   # the slot stays taken while it rests
        return {"PartNumber": number, "ETag": out["ETag"]}

    def _call(self, operation: str, **kwargs) -> dict:
        """One S3 request of this upload; the client's failures raised as ``CheckpointIOError`` (``store_errors``)."""
        with store_errors(f"s3://{self._bucket}/{self._key}", "upload", NOTHING_PUBLISHED):
            return self._fs.call_s3(operation, **kwargs)

    def commit(self) -> None:
        rest = [v for views in self._ready for v in views] + self._pending
        self._ready, self._pending, self._pending_bytes = [], [], 0
        if self._upload_id is None:  # small: one PUT publishes it whole
            body = memoryview(b"".join(rest))
            _send_without_expect_continue(self._fs)
            self._call("put_object", Bucket=self._bucket, Key=self._key, Body=_ViewBody(body),
                       ChecksumCRC32=_crc32_header(body))
        else:
            if rest:
                self._send_part(rest)
            parts = [f.result() for f in self._parts]
            self._call("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                       UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._pool.shutdown(wait=True)
        self._fs.invalidate_cache(f"{self._bucket}/{self._key}")

    def abort(self) -> None:
        self._ready, self._pending = [], []
        if self._pool is not None:
            for f in self._parts:
                f.cancel()
            self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)


class S3PartSink:
    """The sink of an S3 upload (:meth:`FsspecStorage.open_sink`): the writer's pieces become parts
    without a copy. ``piece_bytes`` asks the writer for pieces of a part's size; ``drain`` waits
    for the parts sent so far (a lazy tensor's memory is free after)."""

    hasher = None  # sends the caller's memory itself: the source's hashes are the sent bytes'

    def __init__(self, upload: S3MultipartWriter):
        self._upload = upload
        self.piece_bytes = upload._part_bytes

    def write(self, piece: memoryview) -> None:
        self._upload.write_view(piece)

    def drain(self) -> None:
        self._upload.wait_sent()

    def close(self) -> None:
        pass  # the atomic writer commits (or aborts) the upload

"""How an S3 upload is cut into parts (``fsspec_store.S3MultipartWriter``), against a fake client.

No server: the fake records every call. The properties S3 needs (every part
but the last at least 5 MiB, the parts in order rebuild the file), that a
piece of a part's size goes out as the caller's memory itself (no copy),
that a small file is one PUT and that each part carries its CRC-32.
"""

from __future__ import annotations

import base64
import types
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shardkit import knobs
from shardkit.storage.backends.s3_upload import _MIN_PART_BYTES, S3MultipartWriter, S3PartSink

MIB = 1024 * 1024


class _FakeS3:
    """Just what the writer calls: ``split_path``, ``call_s3``, ``invalidate_cache``."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.objects: dict[str, bytes] = {}
        self._parts: dict[int, bytes] = {}
        self.handlers: list[str] = []
        events = types.SimpleNamespace(register_last=lambda event, handler, unique_id=None: self.handlers.append(event))
        self.s3 = types.SimpleNamespace(meta=types.SimpleNamespace(events=events))  # the botocore client's

    def split_path(self, key):
        bucket, _, rest = key.partition("/")
        return bucket, rest, None

    def invalidate_cache(self, path=None):
        pass

    def call_s3(self, op, **kw):
        body = kw.get("Body")
        if body is not None and not isinstance(body, (bytes, bytearray)):
            kw["sent_view"] = body._view if hasattr(body, "_view") else None
            body = b"".join(bytes(c) for c in iter(lambda: body.read(1 << 20), b""))
        if body is not None:
            crc = base64.b64encode((zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "big")).decode()
            assert kw.get("ChecksumCRC32") == crc, "each body carries its own CRC-32"
        self.calls.append((op, kw))
        if op == "create_multipart_upload":
            return {"UploadId": "u1"}
        if op == "upload_part":
            self._parts[kw["PartNumber"]] = bytes(body)
            return {"ETag": f"e{kw['PartNumber']}"}
        if op == "complete_multipart_upload":
            numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
            assert numbers == list(range(1, len(numbers) + 1))
            self.objects[kw["Key"]] = b"".join(self._parts[n] for n in numbers)
            return {}
        if op == "put_object":
            self.objects[kw["Key"]] = bytes(body)
            return {}
        raise AssertionError(f"unexpected call {op}")

    def part_sizes(self) -> list[int]:
        return [len(self._parts[n]) for n in sorted(self._parts)]


def _upload(pieces: list[bytes], part_bytes: int, monkeypatch) -> _FakeS3:
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", part_bytes)
    fs = _FakeS3()
    writer = S3MultipartWriter(fs, "bucket/file")
    sink = S3PartSink(writer)
    for piece in pieces:
        sink.write(memoryview(piece))
    sink.drain()
    writer.commit()
    return fs


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 9 * MIB), min_size=1, max_size=8), st.sampled_from([5 * MIB, 8 * MIB]))
def test_parts_rebuild_the_file_and_all_but_the_last_are_at_least_5_mib(sizes, part_bytes):
    saved = knobs.OBJECT_PART_BYTES
    knobs.OBJECT_PART_BYTES = part_bytes
    try:
        pieces = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
        fs = _FakeS3()
        writer = S3MultipartWriter(fs, "bucket/file")
        sink = S3PartSink(writer)
        for piece in pieces:
            sink.write(memoryview(piece))
        writer.commit()
    finally:
        knobs.OBJECT_PART_BYTES = saved
    assert fs.objects["file"] == b"".join(pieces)
    parts = fs.part_sizes()
    assert all(n >= _MIN_PART_BYTES for n in parts[:-1])
    assert all(n <= part_bytes + _MIN_PART_BYTES for n in parts)
    if sum(sizes) < part_bytes:
        assert [op for op, _ in fs.calls] == ["put_object"]  # small: one PUT, no multipart upload


def test_a_piece_of_a_part_s_size_is_sent_from_the_caller_s_memory(monkeypatch):
    big = np.arange(32 * MIB, dtype=np.uint8)
    pieces = [b"header"] + [memoryview(big)[i:i + 8 * MIB] for i in range(0, 32 * MIB, 8 * MIB)]
    fs = _upload(pieces, 8 * MIB, monkeypatch)
    assert fs.objects["file"] == b"header" + big.tobytes()
    sent = [kw["sent_view"] for op, kw in fs.calls if op == "upload_part"]
    # The header is joined with (a copy of) the first piece; every other piece goes as it is.
    shared = [v for v in sent if np.shares_memory(np.frombuffer(v, np.uint8), big)]
    assert sum(len(v) for v in shared) == 24 * MIB and len(sent) == 4
    assert [op for op, _ in fs.calls] == ["create_multipart_upload"] + ["upload_part"] * 4 + [
        "complete_multipart_upload"]
    assert fs.handlers == ["before-call.s3"] * 4  # parts are sent without 100-continue


def test_file_writes_copy_so_the_caller_may_reuse_its_buffer(monkeypatch):
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", 5 * MIB)
    fs = _FakeS3()
    writer = S3MultipartWriter(fs, "bucket/file")
    buf = bytearray(3 * MIB)
    for value in (1, 2, 3):
        buf[:] = bytes([value]) * len(buf)
        writer.write(buf)
    writer.commit()
    assert fs.objects["file"] == b"".join(bytes([v]) * 3 * MIB for v in (1, 2, 3))


def _tiny_parts(monkeypatch, part_bytes: int = 16, min_part_bytes: int = 8) -> None:
    """S3's part sizes scaled down to bytes, so thousands of parts take milliseconds."""
    import shardkit.storage.backends.s3_upload as s3_upload

    monkeypatch.setattr(s3_upload, "_MIN_PART_BYTES", min_part_bytes)
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", part_bytes)


def test_thousands_of_parts_that_finish_at_once_never_break_the_in_flight_limit(monkeypatch):
    # parts finishing between the count of those in flight and the wait for one raised StopIteration
    _tiny_parts(monkeypatch)
    monkeypatch.setattr(knobs, "OBJECT_UPLOAD_PARTS_IN_FLIGHT", 2)
    data = bytes(range(256)) * 250  # 64000 bytes: thousands of parts
    fs = _FakeS3()
    writer = S3MultipartWriter(fs, "bucket/file")
    sink = S3PartSink(writer)
    for start in range(0, len(data), 16):
        sink.write(memoryview(data)[start:start + 16])
    writer.commit()
    assert fs.objects["file"] == data and len(fs.part_sizes()) > 2000


@pytest.mark.parametrize("known_size", [True, False])
def test_a_file_larger_than_10000_default_parts_still_fits_s3_s_10000(monkeypatch, known_size):
    # 16 MiB parts cover 160 GiB; past it S3 refuses part 10,001, after everything was sent
    _tiny_parts(monkeypatch)
    data = np.random.default_rng(0).integers(0, 256, 25_000 * 16, dtype=np.uint8).tobytes()
    fs = _FakeS3()
    writer = S3MultipartWriter(fs, "bucket/file")
    if known_size:
        writer.expect_bytes(len(data))  # what FsspecStorage.open_sink does with the writer's size
        sink = S3PartSink(writer)
        for start in range(0, len(data), sink.piece_bytes):
            sink.write(memoryview(data)[start:start + sink.piece_bytes])
    else:  # torch.save's writes: the size is not known ahead
        for start in range(0, len(data), 16):
            writer.write(data[start:start + 16])
    writer.commit()
    assert fs.objects["file"] == data
    assert len(fs.part_sizes()) <= 10_000
    assert all(n >= 8 for n in fs.part_sizes()[:-1])


def test_a_file_over_s3_s_5_tib_object_limit_is_refused_before_any_upload():
    from shardkit.errors import CheckpointIOError

    fs = _FakeS3()
    writer = S3MultipartWriter(fs, "bucket/big.safetensors")
    with pytest.raises(CheckpointIOError, match="over S3's limit of 5 TiB.*Nothing was uploaded"):
        writer.expect_bytes(6 * 1024**4)
    assert fs.calls == []

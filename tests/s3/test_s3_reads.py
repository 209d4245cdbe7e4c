"""S3 reads stream into the caller's buffers (``fsspec_readers.S3RangeReader``): any split into buffers and parts."""

from __future__ import annotations

import pytest

from shardkit import knobs
from shardkit.storage import fetched_bytes, storage_for

DATA = bytes(range(251)) * 4000  # about 1 MiB


@pytest.mark.parametrize("part_bytes, in_flight", [(1 << 20, 8), (100_000, 3), (4096, 1)])
def test_s3_gather_reads_stream_the_right_bytes_into_every_buffer(s3_url, monkeypatch, part_bytes, in_flight):
    store, path = storage_for(s3_url + "/blob")
    with store.atomic_writer(path) as f:
        f.write(DATA)
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", part_bytes)
    monkeypatch.setattr(knobs, "OBJECT_PARTS_IN_FLIGHT", in_flight)
    sizes = [0, 1, 300_000, 7, 4096, 250_001]
    with store.open_reader(path) as reader:
        views = [memoryview(bytearray(n)) for n in sizes]
        before = fetched_bytes()
        reader.read_into_views(12_345, views)
        assert fetched_bytes() - before == sum(sizes)
        assert b"".join(bytes(v) for v in views) == DATA[12_345:12_345 + sum(sizes)]
        out = memoryview(bytearray(5000))
        reader.read_into(len(DATA) - 5000, out)
        assert bytes(out) == DATA[-5000:]
        with pytest.raises(EOFError, match="truncated"):
            reader.read_into_views(len(DATA) - 100, [memoryview(bytearray(64)), memoryview(bytearray(64))])


def test_a_response_that_is_not_the_range_asked_for_is_refused_never_used(s3_url, monkeypatch):
    from shardkit.errors import CheckpointIOError

    store, path = storage_for(s3_url + "/blob")
    with store.atomic_writer(path) as f:
        f.write(DATA)
    reader = store.open_reader(path)
    real = store.fs._call_s3

    async def ignores_ranges(method, *args, **kwargs):  # a proxy that drops the Range header
        kwargs.pop("Range", None)
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", ignores_ranges)
    out = memoryview(bytearray(1000))
    with pytest.raises(CheckpointIOError, match="asked the object store for bytes 5000-5999.*whole object") as e:
        reader.read_into(5000, out)
    assert e.value.errno == 5 and bytes(out) == bytes(1000)
    monkeypatch.setattr(store.fs, "_call_s3", real)
    with store.atomic_writer(path) as f:  # replaced by another writer since the reader opened it
        f.write(DATA[:-10])
    with pytest.raises(CheckpointIOError, match="changed since it was opened"):
        reader.read_into(5000, out)
    reader.close()

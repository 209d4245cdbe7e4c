"""Gather reads through fsspec (``memory://``): any split of a range into buffers and parts gives the same bytes."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import knobs
from shardkit.storage import fetched_bytes, storage_for

DATA = bytes(range(251)) * 40  # 10040 bytes, no period that divides a power of two


@pytest.fixture(scope="module")
def reader():
    url = f"memory://shardkit-reads-{uuid.uuid4().hex}/blob"
    store, path = storage_for(url)
    with store.atomic_writer(path) as f:
        f.write(DATA)
    with store.open_reader(path) as r:
        yield r


@settings(max_examples=80, deadline=None)
@given(offset=st.integers(0, 3000), sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=6),
       part_bytes=st.integers(1, 4000))
def test_read_into_views_fills_each_buffer_in_order(reader, offset, sizes, part_bytes):
    views = [memoryview(bytearray(n)) for n in sizes]
    saved, knobs.OBJECT_PART_BYTES = knobs.OBJECT_PART_BYTES, part_bytes
    try:
        before = fetched_bytes()
        reader.read_into_views(offset, views)
    finally:
        knobs.OBJECT_PART_BYTES = saved
    assert b"".join(bytes(v) for v in views) == DATA[offset:offset + sum(sizes)]
    assert fetched_bytes() - before >= sum(sizes)  # other tests' reads may count too, never fewer


def test_a_gather_read_past_the_end_is_refused(reader):
    with pytest.raises(EOFError, match="truncated"):
        reader.read_into_views(len(DATA) - 10, [memoryview(bytearray(8)), memoryview(bytearray(8))])


@pytest.mark.parametrize("parts", [1, 3])
def test_a_store_that_ignores_the_range_is_refused_not_read_from_the_start(monkeypatch, parts):
    from shardkit.errors import CheckpointIOError

    store, path = storage_for(f"memory://shardkit-reads-{uuid.uuid4().hex}/blob")
    with store.atomic_writer(path) as f:
        f.write(DATA)
    whole = store.fs.cat_file(path)
    monkeypatch.setattr(store.fs, "cat_file", lambda *a, **k: whole)        # a server that sends it all
    monkeypatch.setattr(store.fs, "cat_ranges", lambda paths, *a, **k: [whole] * len(paths))
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", 400 // parts + 1)
    out = memoryview(bytearray(400))
    with store.open_reader(path) as r, pytest.raises(CheckpointIOError, match="bytes 1000-") as e:
        r.read_into(1000, out)
    assert "does not honour HTTP range requests" in str(e.value) and e.value.errno == 5

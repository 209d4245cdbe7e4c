"""LocalStorage readers: mapped and preadv reads give the same bytes and the same errors."""

import os

import numpy as np
import pytest

from shardkit import knobs
from shardkit.storage import LocalStorage


@pytest.fixture(params=[True, False], ids=["mapped", "preadv"])
def mapped(request, monkeypatch):
    monkeypatch.setattr(knobs, "MMAP_READS", request.param)
    monkeypatch.setattr(knobs, "MMAP_READ_MIN_BYTES", 1000)
    return request.param


def _file(tmp_path, n):
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return str(path), data


def test_reads_at_any_offset_and_size(tmp_path, mapped):
    path, data = _file(tmp_path, 300_001)
    with LocalStorage().open_reader(path) as r:
        for offset, length in ((0, 300_001), (1, 4096), (12_345, 200_000), (299_000, 1001), (7, 3)):
            out = bytearray(length)
            r.read_into(offset, memoryview(out))
            assert bytes(out) == data[offset:offset + length]


def test_read_past_the_end_is_an_eof_error_naming_the_file(tmp_path, mapped):
    path, _ = _file(tmp_path, 5000)
    with LocalStorage().open_reader(path) as r:
        with pytest.raises(EOFError, match="f.bin.*truncated"):
            r.read_into(4000, memoryview(bytearray(2000)))


def test_reads_into_a_typed_view_and_parallel_threads(tmp_path, mapped):
    from shardkit.storage import run_parallel

    path, data = _file(tmp_path, 64 * 1024)
    out = np.zeros(16 * 1024, dtype=np.float32)
    view = memoryview(out)
    with LocalStorage().open_reader(path) as r:
        run_parallel([lambda i=i: r.read_into(i * 16384, view[i * 4096:(i + 1) * 4096]) for i in range(4)])
    assert out.tobytes() == data


def test_empty_file_and_close_twice(tmp_path, mapped):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    r = LocalStorage().open_reader(str(path))
    r.read_into(0, memoryview(bytearray(0)))
    r.close()
    r.close()


def test_a_file_replaced_after_open_is_still_read_whole(tmp_path, mapped):
    path, data = _file(tmp_path, 50_000)
    with LocalStorage().open_reader(path) as r:
        new = tmp_path / "new.bin"
        new.write_bytes(b"x" * 10)
        os.replace(new, path)  # an atomic replace, as shardkit's writers do
        out = bytearray(50_000)
        r.read_into(0, memoryview(out))
    assert bytes(out) == data


def test_a_reader_dropped_without_close_gives_its_descriptor_back(tmp_path, mapped):
    import gc

    from fds import open_on

    path, data = _file(tmp_path, 5000)

    for _ in range(20):
        reader = LocalStorage().open_reader(path)
        out = bytearray(5000)
        reader.read_into(0, memoryview(out))
        assert bytes(out) == data and open_on(path) >= 1
        del reader
    gc.collect()
    assert open_on(path) == 0
    reader = LocalStorage().open_reader(path)
    reader.close()
    reader.close()  # twice: still fine, and the collector closes nothing more
    assert open_on(path) == 0
    del reader
    gc.collect()


def test_new_directories_are_synced_into_their_parents(tmp_path, monkeypatch):
    import shardkit.storage.backends.atomic as atomic
    from shardkit.storage.backends.lock import local_writer_lock

    synced = []
    monkeypatch.setattr(atomic, "fsync_dir", lambda path: synced.append(os.path.relpath(path, tmp_path)))
    LocalStorage().makedirs(str(tmp_path / "run" / "step-1"))
    assert synced == [".", "run"]  # top down: each new entry made durable in its parent
    synced.clear()
    LocalStorage().makedirs(str(tmp_path / "run" / "step-1"))
    assert synced == []  # nothing new: nothing to sync
    with local_writer_lock(str(tmp_path / "run" / "step-2")):  # a save's lock makes its directory first
        assert synced == ["run"]


def test_a_map_without_prefetch_queues_no_read_ahead(tmp_path, monkeypatch):
    import shardkit.storage.backends.local as local

    queued = []
    monkeypatch.setattr(local, "prefetch_mapped", lambda mapping, ranges: queued.append(ranges) or 0)
    path, data = _file(tmp_path, 200_000)
    with LocalStorage().open_reader(path) as r:
        quiet = r.map_range(5000, 100_000, prefetch=False)
        assert bytes(quiet) == data[5000:105_000] and queued == []
        assert bytes(r.map_range(7, 10)) == data[7:17] and queued == [[(7, 10)]]

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from shardkit.storage import BufferReader
from shardkit.storage import BlockHasher
from shardkit.storage import FileRecord
from safetensors.torch import load_file

from shardkit import knobs
from shardkit.errors import ChecksumError, IncompleteCheckpointError, MetadataError
from shardkit.storage import byte_view, read_header, read_ranges, storage_for, write_safetensors

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def _sample(dtype, shape):
    return (torch.randn(shape) * 10).to(dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 64)
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 48)


def _write(tmp_path, tensors, metadata=None):
    store, path = storage_for(tmp_path / "f.safetensors")
    record = write_safetensors(store, path, list(tensors.items()), metadata)
    return store, path, record


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_written_file_opens_with_safetensors(tmp_path, small_blocks, dtype):
    tensors = {"a": _sample(dtype, (3, 5)), "scalar": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    _, path, record = _write(tmp_path, tensors, {"format": "pt"})
    loaded = load_file(path)
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert record.bytes == (tmp_path / "f.safetensors").stat().st_size


def test_non_contiguous_and_unicode_names(tmp_path):
    t = torch.arange(24.0).reshape(4, 6).t()
    _, path, _ = _write(tmp_path, {"ünï.çødé": t})
    assert torch.equal(load_file(path)["ünï.çødé"], t)


def test_read_ranges_verified_roundtrip(tmp_path, small_blocks):
    tensors = {"a": torch.arange(100, dtype=torch.float32), "b": torch.arange(7, dtype=torch.int16)}
    store, path, record = _write(tmp_path, tensors)
    with store.open_reader(path) as r:
        header = read_header(r)
        a = torch.empty(100)
        part = torch.empty(10)
        entry = header.tensors["a"]
        read_ranges(r, [(entry.begin, byte_view(a)), (entry.begin + 40, byte_view(part))], record)
    assert torch.equal(a, tensors["a"]) and torch.equal(part, tensors["a"][10:20])


def test_flipped_byte_is_detected(tmp_path, small_blocks):
    store, path, record = _write(tmp_path, {"a": torch.arange(100, dtype=torch.float32)})
    raw = bytearray((tmp_path / "f.safetensors").read_bytes())
    raw[-5] ^= 0x01
    (tmp_path / "f.safetensors").write_bytes(bytes(raw))
    with store.open_reader(path) as r:
        entry = read_header(r).tensors["a"]
        out = torch.empty(100)
        read_ranges(r, [(entry.begin, byte_view(out)[:40])], record)  # untouched block: fine
        with pytest.raises(ChecksumError, match="corrupt"):
            read_ranges(r, [(entry.begin, byte_view(out))], record)


def test_truncated_file_is_reported(tmp_path, small_blocks):
    store, path, record = _write(tmp_path, {"a": torch.arange(100, dtype=torch.float32)})
    raw = (tmp_path / "f.safetensors").read_bytes()
    (tmp_path / "f.safetensors").write_bytes(raw[:-10])
    with store.open_reader(path) as r:
        with pytest.raises(MetadataError, match="truncated"):
            read_header(r)
        with pytest.raises(IncompleteCheckpointError, match="records"):
            read_ranges(r, [(100, memoryview(bytearray(4)))], record)


def test_huge_declared_header_is_refused(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    store, path = storage_for(tmp_path / "bad.safetensors")
    with store.open_reader(path) as r, pytest.raises(MetadataError, match="declares a header"):
        read_header(r)


def test_invalid_header_json(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    store, path = storage_for(tmp_path / "bad.safetensors")
    with store.open_reader(path) as r, pytest.raises(MetadataError, match="not valid JSON"):
        read_header(r)


def test_fsspec_memory_backend_roundtrip():
    store, path = storage_for("memory://shardkit-test/x.safetensors")
    store.makedirs("memory://shardkit-test")
    record = write_safetensors(store, path, [("w", torch.ones(3, 3))])
    with store.open_reader(path) as r:
        entry = read_header(r).tensors["w"]
        out = torch.empty(3, 3)
        read_ranges(r, [(entry.begin, byte_view(out))], record)
    assert torch.equal(out, torch.ones(3, 3))
    assert "x.safetensors" in store.listdir("memory://shardkit-test")


def test_lazy_tensors_are_produced_one_at_a_time(tmp_path, small_blocks):
    from shardkit.storage import LazyTensor

    produced = []

    def make(i):
        def load():
            produced.append(i)
            return torch.full((5,), float(i))
        return load

    lazy = [(f"t{i}", LazyTensor(torch.float32, (5,), make(i))) for i in range(3)]
    store, path = storage_for(tmp_path / "lazy.safetensors")
    record = write_safetensors(store, path, lazy)
    assert produced == [0, 1, 2]
    loaded = load_file(path)
    assert all(torch.equal(loaded[f"t{i}"], torch.full((5,), float(i))) for i in range(3))
    assert record.bytes == (tmp_path / "lazy.safetensors").stat().st_size


def test_write_without_checksum_returns_no_record_and_a_valid_file(tmp_path):
    from safetensors.torch import load_file

    from shardkit.storage import LocalStorage, write_safetensors

    t = {"a": torch.arange(10, dtype=torch.int64), "b": torch.ones(3, 3, dtype=torch.bfloat16)}
    path = str(tmp_path / "x.safetensors")
    assert write_safetensors(LocalStorage(), path, list(t.items()), checksum=False) is None
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in t.items())


class _CountingRemoteReader(BufferReader):
    """A reader over memory that, like an object store, charges for every byte it reads."""

    extra_reads_are_cheap = False

    def __init__(self, data: bytes):
        super().__init__("remote", data)
        self.read_bytes = 0

    def read_into(self, offset, out):
        self.read_bytes += len(out)
        super().read_into(offset, out)


def _record_of(data: bytes, block_bytes: int) -> FileRecord:
    hasher = BlockHasher(block_bytes)
    hasher.update(memoryview(data))
    return hasher.finish()


def test_a_remote_verified_read_fetches_only_what_it_wants_and_verifies_whole_blocks():
    block = 64
    data = bytes(range(256)) * 2                       # 512 bytes: 8 blocks
    record = _record_of(data, block)
    reader = _CountingRemoteReader(data)
    wanted = [(10, memoryview(bytearray(20))), (128, memoryview(bytearray(block * 2)))]   # part of block 0; blocks 2-3
    read_ranges(reader, wanted, record)
    assert reader.read_bytes == 20 + 2 * block         # nothing outside the reads
    assert bytes(wanted[0][1]) == data[10:30] and bytes(wanted[1][1]) == data[128:256]
    corrupt = bytearray(data)
    corrupt[130] ^= 0xFF                               # inside block 2, which the second read covers whole
    with pytest.raises(ChecksumError):
        read_ranges(_CountingRemoteReader(bytes(corrupt)), [(128, memoryview(bytearray(block * 2)))], record)


class _GatherCountingRemoteReader(_CountingRemoteReader):
    """Also counts requests: each gather read (one contiguous range) is one, as on an object store."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.requests = 0

    def read_into_views(self, offset, views):
        self.requests += 1
        for view in views:
            super().read_into(offset, view)
            offset += len(view)

    def read_into(self, offset, out):
        self.requests += 1
        super().read_into(offset, out)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 511), max_size=12, unique=True), gaps=st.lists(st.booleans(), min_size=13, max_size=13),
       verified=st.booleans())
def test_remote_reads_of_adjacent_buffers_are_gathered_and_fetch_only_what_is_wanted(cuts, gaps, verified):
    block = 64
    data = bytes(range(256)) * 2
    bounds = [0, *sorted(cuts), len(data)]
    wanted = [(lo, memoryview(bytearray(hi - lo))) for (lo, hi), skip in zip(zip(bounds, bounds[1:]), gaps) if not skip]
    reader = _GatherCountingRemoteReader(data)
    read_ranges(reader, wanted, _record_of(data, block) if verified else None)
    assert all(bytes(buf) == data[lo:lo + len(buf)] for lo, buf in wanted)
    assert reader.read_bytes == sum(len(buf) for _, buf in wanted)    # never a byte nobody asked for
    if not any(gaps[:len(bounds) - 1]):                               # the reads tile the file
        assert reader.requests == 1                                   # verified or not: one gather read


@pytest.mark.parametrize("part_bytes, in_flight, requests", [(64, 2, 4), (64, 8, 1), (1, 1, 8)])
def test_remote_verified_reads_fetch_stretches_of_blocks_as_one_request(monkeypatch, part_bytes, in_flight, requests):
    # A stretch holds at most part x in-flight bytes, and never less than one block.
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", part_bytes)
    monkeypatch.setattr(knobs, "OBJECT_PARTS_IN_FLIGHT", in_flight)
    data = bytes(range(256)) * 2                                       # 8 blocks of 64
    bounds = [0, 30, 64, 200, 333, 512]
    wanted = [(lo, memoryview(bytearray(hi - lo))) for lo, hi in zip(bounds, bounds[1:])]
    reader = _GatherCountingRemoteReader(data)
    read_ranges(reader, wanted, _record_of(data, 64))
    assert reader.requests == requests
    assert b"".join(bytes(buf) for _, buf in wanted) == data


def test_a_flipped_byte_in_a_stretch_names_its_block():
    data = bytes(range(256)) * 2
    record = _record_of(data, 64)
    corrupt = bytearray(data)
    corrupt[300] ^= 0x01                                               # block 4 of 8
    with pytest.raises(ChecksumError, match=r"bytes 256\.\.320 "):
        read_ranges(_GatherCountingRemoteReader(bytes(corrupt)), [(0, memoryview(bytearray(512)))], record)


def test_overlapping_remote_reads_are_still_verified():
    data = bytes(range(256)) * 2
    record = _record_of(data, 64)
    wanted = [(0, memoryview(bytearray(100))), (50, memoryview(bytearray(462)))]   # bytes 50..99 wanted twice
    read_ranges(_GatherCountingRemoteReader(data), wanted, record)
    assert bytes(wanted[0][1]) == data[:100] and bytes(wanted[1][1]) == data[50:]
    corrupt = bytearray(data)
    corrupt[60] ^= 0x01
    with pytest.raises(ChecksumError):
        read_ranges(_GatherCountingRemoteReader(bytes(corrupt)), wanted, record)


@pytest.mark.parametrize("offset, nbytes", [(140, 40), (150, 1), (-5, 10)])
def test_a_verified_read_outside_the_file_raises_like_an_unverified_one(offset, nbytes):
    # The block walk clips blocks to the file: without the check, bytes 150.. of
    # the first case were left unwritten without an error.
    data = b"A" * 150
    record = _record_of(data, 100)
    out = memoryview(bytearray(b"\xee" * nbytes))
    with pytest.raises(EOFError, match="wanted"):
        read_ranges(BufferReader("f", data), [(offset, out)], record)
    with pytest.raises(EOFError, match="wanted"):
        read_ranges(BufferReader("f", data), [(offset, out)])


def test_an_object_store_read_outside_the_file_raises():
    store, path = storage_for("memory://shardkit-outside/f.bin")
    with store.atomic_writer(path) as f:
        f.write(b"B" * 150)
    with store.open_reader(path) as reader:
        for offset, nbytes in [(140, 40), (-5, 10)]:
            with pytest.raises(EOFError, match="wanted"):
                read_ranges(reader, [(offset, memoryview(bytearray(nbytes)))])
    store.remove(path)

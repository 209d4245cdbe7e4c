"""The extension's xxh3 hasher and copy_and_hash: xxhash's digests, every byte copied, corruption still caught."""

import contextlib
import threading

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import knobs
from shardkit.errors import ChecksumError
from shardkit.storage import checksum, new_block_hasher, read_header, read_ranges, storage_for, write_safetensors
import shardkit.storage.fast_io.memcopy as memcopy
from shardkit.storage.fast_io.memcopy import buffer_address

Xxh3 = checksum._Xxh3
needs_extension = pytest.mark.skipif(Xxh3 is None, reason="shardkit._stream_copy was not built here")


@contextlib.contextmanager
def _simd(avx2: bool):
    """Run the extension's AVX2 loops or, as on a CPU without AVX2, its SSE2 ones."""
    from shardkit import _stream_copy

    before = _stream_copy._use_avx2(True)
    if avx2 and not before:
        pytest.skip("this CPU has no AVX2")
    _stream_copy._use_avx2(avx2)
    try:
        yield
    finally:
        _stream_copy._use_avx2(before)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["fused", "sliced"])
def hasher_kind(request, monkeypatch):
    """``fused``: the extension's hasher, one C pass; ``sliced``: xxhash's hasher, copy then hash per slice."""
    if request.param == "fused":
        if Xxh3 is None:
            pytest.skip("shardkit._stream_copy was not built here")
        return Xxh3
    monkeypatch.setattr(knobs, "HASH_SLICE_BYTES", 1000)  # many slices, one of them short
    return xxhash.xxh3_64


@needs_extension
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_digests_are_xxhash_ones_however_the_bytes_are_fed(data, cuts):
    hasher = Xxh3()
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for lo, hi in zip(bounds, bounds[1:]):
        hasher.update(memoryview(data)[lo:hi])
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(data)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)


@needs_extension
def test_large_updates_and_the_empty_digest():
    big = _bytes(3 * 1024 * 1024 + 5)
    hasher = Xxh3()
    hasher.update(big.numpy())
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(big.numpy().tobytes())
    assert Xxh3().hexdigest() == xxhash.xxh3_64_hexdigest(b"") == "2d06800538d394c2"


@needs_extension
def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError):
        Xxh3(b"seed")
    with pytest.raises(TypeError):
        Xxh3().update("text is not bytes")


@needs_extension
def test_threads_sharing_one_hasher_lose_no_update():
    # Updates are serialised, so the digest is that of the pieces in some order: XOR of lengths checks none was lost.
    piece = _bytes(256 * 1024).numpy()
    hasher = Xxh3()
    threads = [threading.Thread(target=lambda: [hasher.update(piece) for _ in range(8)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(piece.tobytes() * 32)


@pytest.mark.parametrize("n, src_off, dst_off", [(0, 0, 0), (1, 3, 5), (4095, 1, 0),
                                                 (256 * 1024 + 7, 5, 17), (3 * 1024 * 1024 + 1, 0, 1)])
def test_copy_and_hash_copies_every_byte_and_hashes_them(hasher_kind, n, src_off, dst_off):
    src, dst = _bytes(n + 64, seed=n), torch.zeros(n + 64, dtype=torch.uint8)
    hasher = hasher_kind()
    view = memoryview(src.numpy())[src_off:src_off + n]
    memcopy.copy_and_hash(dst.data_ptr() + dst_off, view, hasher)
    assert torch.equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert not dst[:dst_off].any() and not dst[dst_off + n:].any()  # nothing outside the range
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(view.tobytes())


@needs_extension
@pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "sse2"])
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 70_000), src_off=st.integers(0, 63), dst_off=st.integers(0, 63),
       prefix=st.integers(0, 700), cuts=st.lists(st.integers(0, 70_000), max_size=5))
def test_copy_update_in_pieces_at_any_alignment_is_xxhash_and_a_copy(avx2, n, src_off, dst_off, prefix, cuts):
    # AVX2: the fused accumulate stores aligned windows that need not start where xxh3's stripes do;
    # the bytes xxh3 buffers (a prefix fed by update(), each piece's head and tail) are copied apart.
    # SSE2 (a CPU without AVX2): a stride is copied, then hashed.
    with _simd(avx2):
        _copy_update_in_pieces(n, src_off, dst_off, prefix, cuts)


def _copy_update_in_pieces(n, src_off, dst_off, prefix, cuts):
    src, dst = _bytes(n + 64, seed=n), torch.zeros(n + 128, dtype=torch.uint8)
    data = src.numpy()[src_off:src_off + n]
    head = bytes(range(256)) * 3
    hasher = Xxh3()
    hasher.update(head[:prefix])
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    for lo, hi in zip(bounds, bounds[1:]):
        hasher.copy_update(dst.data_ptr() + dst_off + lo, buffer_address(data) + lo, hi - lo)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(head[:prefix] + data.tobytes())
    assert torch.equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert not dst[:dst_off].any() and not dst[dst_off + n:].any()


_GUARD_PAGE_SCRIPT = """
import ctypes, mmap, sys, xxhash
from shardkit._stream_copy import Xxh3, _use_avx2
_use_avx2(sys.argv[1] == "avx2")
page = mmap.PAGESIZE
region = mmap.mmap(-1, 9 * page)
libc = ctypes.CDLL(None, use_errno=True)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
assert libc.mprotect(ctypes.c_void_p(base + 8 * page), page, 0) == 0  # the page after the source: no access
for n in (1, 63, 64, 257, 1000, 4097, 8 * page - 1, 8 * page):
    for dst_off in range(0, 64, 7):
        src = base + 8 * page - n  # the source ends where the guard page begins
        region[8 * page - n:8 * page] = bytes(i % 251 for i in range(n))
        dst = ctypes.create_string_buffer(n + 64)
        hasher = Xxh3()
        hasher.copy_update(ctypes.addressof(dst) + dst_off, src, n)
        assert dst.raw[dst_off:dst_off + n] == region[8 * page - n:8 * page]
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(region[8 * page - n:8 * page])
print("ok")
"""


@needs_extension
@pytest.mark.parametrize("simd", ["avx2", "sse2"])
def test_copy_update_never_reads_past_the_source(simd):
    # A source that ends at a no-access page: one byte read past it is a crash, so it runs in a child.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GUARD_PAGE_SCRIPT, simd], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_extension
def test_copy_and_hash_without_streaming_copies_takes_the_sliced_path(monkeypatch):
    monkeypatch.setattr(knobs, "STREAM_COPY", False)
    src, dst = _bytes(2 * 1024 * 1024 + 3), torch.zeros(2 * 1024 * 1024 + 3, dtype=torch.uint8)
    hasher = Xxh3()
    memcopy.copy_and_hash(buffer_address(dst.numpy()), memoryview(src.numpy()), hasher)
    assert torch.equal(dst, src)
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(src.numpy().tobytes())


def test_new_block_hasher_is_the_extensions_where_built():
    assert type(new_block_hasher()) is (Xxh3 if Xxh3 is not None else type(xxhash.xxh3_64()))


@pytest.mark.parametrize("extension", [True, False], ids=["extension", "no-extension"])
@pytest.mark.parametrize("mapped", [True, False])
def test_a_flipped_byte_in_a_large_mapped_read_is_caught(tmp_path, monkeypatch, mapped, extension):
    # Reads of at least MMAP_READ_MIN_BYTES take the page-cache map and copy_and_hash; smaller ones preadv.
    # "no-extension": what an install without a C compiler does (xxhash's hasher, the sliced loop).
    if not extension:
        monkeypatch.setattr(checksum, "_Xxh3", None)
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 1024 * 1024)
    monkeypatch.setattr(knobs, "MMAP_READ_MIN_BYTES", 1 if mapped else 1 << 40)
    tensor = _bytes(3 * 1024 * 1024)
    store, path = storage_for(tmp_path / "f.safetensors")
    record = write_safetensors(store, path, [("w", tensor)])
    with store.open_reader(path) as reader:
        begin = read_header(reader).tensors["w"].begin
        out = torch.empty_like(tensor)
        read_ranges(reader, [(begin, memoryview(out.numpy()))], record)
        assert torch.equal(out, tensor)
    with open(path, "r+b") as f:  # one bit, in the middle of the second block
        f.seek(begin + 1024 * 1024 + 4321)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))
    with store.open_reader(path) as reader, pytest.raises(ChecksumError, match="corrupt"):
        read_ranges(reader, [(begin, memoryview(torch.empty_like(tensor).numpy()))], record)

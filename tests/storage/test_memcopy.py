"""copy_bytes: every byte lands, at any size and alignment, with the streaming extension and without."""

import platform
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import knobs
import shardkit.storage.fast_io.memcopy as memcopy


@pytest.fixture(params=["stream", "stream-sse2", "memmove"])
def path(request, monkeypatch):
    """``stream``: the extension's loop for this CPU; ``stream-sse2``: its SSE2 one (a CPU without AVX2)."""
    if request.param.startswith("stream"):
        if memcopy._stream_copy is None:
            pytest.skip("shardkit._stream_copy was not built here")
        monkeypatch.setattr(knobs, "STREAM_COPY_MIN_BYTES", 1)
        if request.param == "stream-sse2":
            had_avx2 = memcopy._stream_copy._use_avx2(False)
            request.addfinalizer(lambda: memcopy._stream_copy._use_avx2(had_avx2))
    else:
        monkeypatch.setattr(knobs, "STREAM_COPY", False)
    return request.param


def _buffers(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(n + 64, dtype=torch.uint8)
    return src, dst


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000), src_off=st.integers(0, 63), dst_off=st.integers(0, 63))
def test_any_size_and_alignment(n, src_off, dst_off):
    for stream in (True, False):
        knobs_before = (knobs.STREAM_COPY, knobs.STREAM_COPY_MIN_BYTES)
        knobs.STREAM_COPY, knobs.STREAM_COPY_MIN_BYTES = stream, 1
        try:
            src, dst = _buffers(n)
            memcopy.copy_bytes(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
        finally:
            knobs.STREAM_COPY, knobs.STREAM_COPY_MIN_BYTES = knobs_before
        assert torch.equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
        assert not dst[:dst_off].any() and not dst[dst_off + n:].any()  # nothing outside the range


def test_large_copy(path):
    src, dst = _buffers(3 * 1024 * 1024 + 7)
    memcopy.copy_bytes(dst.data_ptr() + 1, src.data_ptr() + 3, 3 * 1024 * 1024 + 7)
    assert torch.equal(dst[1:1 + 3 * 1024 * 1024 + 7], src[3:3 + 3 * 1024 * 1024 + 7])


def test_overlapping_ranges_are_moved_like_memmove(path):
    buf = torch.arange(4096, dtype=torch.int32)
    want = buf[:3000].clone()
    memcopy.copy_bytes(buf.data_ptr() + 400, buf.data_ptr(), 3000 * 4)  # dst overlaps src
    assert torch.equal(buf[100:3100], want)


def test_zero_bytes_touch_nothing(path):
    memcopy.copy_bytes(0, 0, 0)  # no address is dereferenced


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="the extension's streaming loops are for x86-64")
def test_the_extension_is_built_on_x86_64_linux():
    # make test builds it (setup.py); if this fails, staging silently falls back to memmove.
    assert memcopy._stream_copy is not None
    assert "streaming stores" in memcopy.copy_kind()

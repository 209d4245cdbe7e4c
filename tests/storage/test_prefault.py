"""populate_for_write: faults whole pages in, never changes content, never touches memory outside the range."""

from __future__ import annotations

import errno
import mmap
import sys

import pytest
import torch

import shardkit.storage.fast_io.prefault as prefault
from shardkit.storage.fast_io.prefault import PAGE_BYTES, populate_for_write

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux")


@linux_only
def test_populating_a_written_buffer_keeps_every_byte():
    buf = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB, pages present and holding data
    expect = buf.clone()
    populate_for_write(buf.data_ptr(), buf.nbytes)   # True on kernels >= 5.14, False before: same bytes either way
    assert torch.equal(buf, expect)


@linux_only
def test_a_fresh_buffer_is_populated_and_then_written_normally():
    buf = torch.empty(3 * PAGE_BYTES + 17, dtype=torch.uint8)
    done = populate_for_write(buf.data_ptr(), buf.nbytes)
    assert done in (True, False)
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()


def test_a_range_holding_no_whole_page_is_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(prefault, "_madvise", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(prefault, "_unsupported", set())
    assert populate_for_write(PAGE_BYTES + 1, PAGE_BYTES) is False  # straddles two pages, holds neither
    assert populate_for_write(PAGE_BYTES, 0) is False
    assert calls == []
    assert populate_for_write(PAGE_BYTES - 5, 2 * PAGE_BYTES + 10) is True  # rounded inwards: one page, two if aligned
    assert calls == [(PAGE_BYTES, 2 * PAGE_BYTES, prefault._MADV_POPULATE_WRITE)]


def test_a_kernel_without_the_advice_turns_it_off_other_errors_do_not(monkeypatch):
    monkeypatch.setattr(prefault, "_unsupported", set())
    failures = iter([errno.ENOMEM, errno.EINVAL])
    calls = []

    def failing(addr, nbytes, advice):
        calls.append(addr)
        prefault.ctypes.set_errno(next(failures))
        return -1

    monkeypatch.setattr(prefault, "_madvise", failing)
    assert populate_for_write(0, 4 * PAGE_BYTES) is False  # ENOMEM: try again next time
    assert populate_for_write(0, 4 * PAGE_BYTES) is False  # EINVAL: never again
    assert populate_for_write(0, 4 * PAGE_BYTES) is False
    assert len(calls) == 2


@linux_only
def test_pages_already_in_memory_are_not_populated_again(monkeypatch):
    calls = []
    monkeypatch.setattr(prefault, "_madvise", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(prefault, "_unsupported", set())
    present = torch.ones(4 << 20, dtype=torch.uint8)            # every page written
    assert populate_for_write(present.data_ptr(), present.nbytes) is True
    assert calls == []


@linux_only
def test_only_the_span_of_absent_pages_is_populated(monkeypatch):
    calls = []
    monkeypatch.setattr(prefault, "_madvise", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(prefault, "_unsupported", set())
    fresh = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # no page in memory yet
    buf = torch.frombuffer(fresh, dtype=torch.uint8)
    buf[: 16 << 20].fill_(1)                                     # the first half written
    assert populate_for_write(buf.data_ptr(), buf.nbytes) is True
    [(addr, nbytes, advice)] = calls
    end = (buf.data_ptr() + buf.nbytes) // PAGE_BYTES * PAGE_BYTES
    assert advice == prefault._MADV_POPULATE_WRITE
    assert buf.data_ptr() < addr and addr + nbytes == end         # the written half skipped, the rest asked for
    del buf


def test_without_mincore_the_whole_range_is_populated(monkeypatch):
    calls = []
    monkeypatch.setattr(prefault, "_madvise", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(prefault, "_unsupported", set())
    monkeypatch.setattr(prefault, "_mincore", None)
    assert populate_for_write(PAGE_BYTES, 4 * PAGE_BYTES) is True
    assert calls == [(PAGE_BYTES, 4 * PAGE_BYTES, prefault._MADV_POPULATE_WRITE)]

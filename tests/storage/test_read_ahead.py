"""Background read-ahead of mapped files: what gets prefetched, and that it never changes a byte."""

import mmap
import subprocess
import sys
import textwrap

import pytest
import torch

from shardkit import knobs
from shardkit.hf import load_checkpoint, save_checkpoint
from shardkit.storage import LocalStorage
import shardkit.storage.fast_io.map_prefetch as read_ahead
from shardkit.storage.fast_io.memcopy import buffer_address
from shardkit.storage.fast_io.prefault import MADV_POPULATE_READ, PAGE_BYTES
from shardkit.storage.fast_io.map_prefetch import advise_huge_pages, prefetch_mapped, wait_for_prefetch

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux")


def _file(tmp_path, nbytes):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (nbytes // 256))
    return path


def _resident_bytes(addr: int) -> int:
    """Rss of the mapping holding ``addr``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(read_ahead, "advise", lambda addr, n, advice: calls.append((addr, n, advice)) or True)
    return calls


@linux_only
def test_prefetched_ranges_are_mapped_and_read_the_same(tmp_path):
    # The file is large beside the range: the kernel maps whole page-cache folios (up to 2 MiB under
    # the map's huge-page advice) and a fault-around window, so only a loose upper bound is exact.
    # The exact ranges handed to the kernel are checked in test_ranges_are_sorted_joined_chunked_and_bounded.
    mib = 1 << 20
    path = _file(tmp_path, 32 * mib)
    mapping = LocalStorage().map_private(str(path))
    assert _resident_bytes(buffer_address(mapping)) == 0
    assert prefetch_mapped(mapping, [(0, 4 * mib)]) == 4 * mib
    assert wait_for_prefetch(timeout_s=30)
    resident = _resident_bytes(buffer_address(mapping))
    assert 4 * mib <= resident <= 16 * mib or resident == 0  # 0: a kernel without the advice
    assert mapping[:] == path.read_bytes()


def test_ranges_are_sorted_joined_chunked_and_bounded(tmp_path, recorded, monkeypatch):
    monkeypatch.setattr(knobs, "MAP_PREFETCH_CHUNK_BYTES", 1)  # at least 1 MiB per call
    path = _file(tmp_path, 4 << 20)
    mapping = LocalStorage().map_private(str(path))
    base, mib = buffer_address(mapping), 1 << 20
    queued = prefetch_mapped(mapping, [(3 * mib, mib), (0, mib), (mib, mib // 2), (0, 0), (4 * mib - 1, 2), (-1, 5)])
    assert wait_for_prefetch(timeout_s=30)
    assert queued == 2 * mib + mib // 2  # touching ranges joined; empty, overflowing and negative ones dropped
    assert [c for c in recorded if c[2] == MADV_POPULATE_READ] == [(base, mib, MADV_POPULATE_READ), (base + mib, mib // 2, MADV_POPULATE_READ),
                        (base + 3 * mib, mib, MADV_POPULATE_READ)]


def test_the_knob_turns_it_off(tmp_path, recorded, monkeypatch):
    monkeypatch.setattr(knobs, "MAP_PREFETCH", False)
    mapping = LocalStorage().map_private(str(_file(tmp_path, 4 * PAGE_BYTES)))
    assert prefetch_mapped(mapping, [(0, len(mapping))]) == 0
    assert advise_huge_pages(mapping) is False
    assert wait_for_prefetch(timeout_s=30)
    assert recorded == []


def test_a_dict_load_prefetches_only_the_tensors_asked_for(tmp_path, monkeypatch):
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8192), "c": torch.zeros(2, 4096)}
    save_checkpoint(tmp_path, state, safetensors=True)
    queued = []
    monkeypatch.setattr(read_ahead._PREFETCHER, "submit", lambda mapping, jobs: queued.append(jobs))
    out = load_checkpoint(tmp_path, None, keys=["a", "c"])
    assert sorted(out) == ["a", "c"]
    assert sum(n for jobs in queued for _, n in jobs) == state["a"].nbytes + state["c"].nbytes


def test_writes_after_the_prefetch_stay_private(tmp_path):
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    save_checkpoint(tmp_path, state, safetensors=True)
    files = sorted(tmp_path.glob("*.safetensors"))
    before = [f.read_bytes() for f in files]
    loaded = load_checkpoint(tmp_path, None)
    assert wait_for_prefetch(timeout_s=30)
    loaded["w"].fill_(-1.0)
    assert [f.read_bytes() for f in files] == before
    assert torch.equal(load_checkpoint(tmp_path, None)["w"], state["w"])


@linux_only
def test_a_file_truncated_under_the_map_ends_the_prefetch_not_the_process(tmp_path):
    path = _file(tmp_path, 64 * PAGE_BYTES)
    script = textwrap.dedent(f"""
        import os
        from shardkit.storage import LocalStorage
        from shardkit.storage.fast_io.map_prefetch import prefetch_mapped, wait_for_prefetch
        mapping = LocalStorage().map_private({str(path)!r})
        os.truncate({str(path)!r}, {PAGE_BYTES})
        prefetch_mapped(mapping, [(0, len(mapping))])
        assert wait_for_prefetch(timeout_s=30)
        assert mapping[:4] == bytes(range(4))
        print("alive")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"


def test_an_empty_or_unmappable_request_queues_nothing(tmp_path, recorded):
    mapping = mmap.mmap(-1, PAGE_BYTES)
    assert prefetch_mapped(mapping, []) == 0
    assert prefetch_mapped(mapping, [(0, 0), (PAGE_BYTES, 1)]) == 0
    assert wait_for_prefetch(timeout_s=30)
    assert recorded == []


def test_a_private_map_asks_for_large_folios_over_the_whole_file(tmp_path, recorded):
    from shardkit.storage.fast_io.prefault import MADV_HUGEPAGE

    mapping = LocalStorage().map_private(str(_file(tmp_path, 8 * PAGE_BYTES)))
    assert recorded == [(buffer_address(mapping), 8 * PAGE_BYTES, MADV_HUGEPAGE)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_prefetches_on_its_own_thread(tmp_path):
    import os

    path = _file(tmp_path, 64 * PAGE_BYTES)
    mapping = LocalStorage().map_private(str(path))
    prefetch_mapped(mapping, [(0, len(mapping))])  # the parent's thread may be busy at the fork
    pid = os.fork()
    if pid == 0:
        ok = prefetch_mapped(mapping, [(0, len(mapping))]) > 0 and wait_for_prefetch(timeout_s=30)
        os._exit(0 if ok and mapping[:256] == bytes(range(256)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert wait_for_prefetch(timeout_s=30)


def test_a_map_closed_before_its_turn_is_skipped_and_the_thread_goes_on(tmp_path):
    closed = mmap.mmap(-1, 4 * PAGE_BYTES)
    prefetch_mapped(closed, [(0, len(closed))])
    assert wait_for_prefetch(timeout_s=30)
    closed.close()
    read_ahead._PREFETCHER.submit(closed, [(0, 4 * PAGE_BYTES)])  # as if closed while queued
    assert wait_for_prefetch(timeout_s=30)
    mapping = LocalStorage().map_private(str(_file(tmp_path, 4 * PAGE_BYTES)))
    assert prefetch_mapped(mapping, [(0, len(mapping))]) == len(mapping)
    assert wait_for_prefetch(timeout_s=30)

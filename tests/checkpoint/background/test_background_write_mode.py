"""How background saves write: ``knobs.BACKGROUND_DIRECT_IO`` (O_DIRECT or the page cache) and
``knobs.BACKGROUND_DISK_SHARE`` (the writer's pace); ``save`` always writes with O_DIRECT, unpaced."""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit import knobs
from shardkit.storage import BlockHasher
from shardkit.storage.fast_io import sinks
from shardkit.checkpoint.background.future import CheckpointFuture
from shardkit.errors import AsyncWaitTimeout
from shardkit.storage.fast_io.direct_io import ALIGN_BYTES, open_direct_sink
from shardkit.storage.fast_io.write_mode import FOREGROUND, Pace, WriteMode


@pytest.fixture
def modes_opened(monkeypatch):
    opened = []
    real = sinks.local_sink

    def spy(fd, durable, checksum=False, size_bytes=None, inline=False, mode=FOREGROUND):
        opened.append((mode.o_direct, None if mode.pace is None else mode.pace.asked_share))
        return real(fd, durable, checksum, size_bytes, inline, mode)

    monkeypatch.setattr(sinks, "local_sink", spy)
    return opened


STATE = {"w": torch.arange(2 << 20, dtype=torch.float32)}   # 8 MiB: above SMALL_FILE_BYTES, a real sink


def _loads_back(path) -> None:
    out = {"w": torch.zeros(2 << 20)}
    ck.load(out, str(path))
    assert torch.equal(out["w"], STATE["w"])
    assert ck.validate_distributed(str(path)).ok


def test_background_saves_take_the_knobs_mode_and_save_takes_the_foreground_one(tmp_path, modes_opened,
                                                                                monkeypatch):
    ck.async_save(STATE, str(tmp_path / "d")).wait()
    default_share = knobs.BACKGROUND_DISK_SHARE
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", 0.5)
    ck.async_save(STATE, str(tmp_path / "a")).wait()
    ck.save(STATE, str(tmp_path / "s"))
    assert modes_opened == [(True, default_share), (False, 0.5), (True, None)]
    _loads_back(tmp_path / "a")


def test_the_async_checkpointer_writes_as_a_background_save(tmp_path, modes_opened, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", 0.5)
    with ck.AsyncCheckpointer(str(tmp_path / "c"), 0, 1, None) as checkpointer:
        checkpointer.save_async(STATE).wait()
    assert modes_opened == [(True, 0.5)]


def test_the_manager_saves_through_the_page_cache_incremental_too(tmp_path, modes_opened, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)
    state = {"w": STATE["w"].clone(), "v": torch.ones(2 << 20)}
    with ck.CheckpointManager(str(tmp_path), incremental=True) as manager:
        manager.save(0, state)
        manager.wait()
        state["v"].add_(1)
        manager.save(1, state)
        manager.wait()
    assert modes_opened and all(not o_direct for o_direct, _ in modes_opened)


@pytest.mark.parametrize("share", [0.0, -1.0, 1.5, float("nan")])
def test_a_share_outside_0_to_1_is_refused_before_anything_is_staged(tmp_path, monkeypatch, share):
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", share)
    with pytest.raises(ValueError, match="disk share must be in"):
        ck.async_save(STATE, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", 1.0)   # nothing left half-started: the next save works
    ck.async_save(STATE, str(tmp_path / "y")).wait()


class _TracedWrites:
    """``os.pwrite`` replaced by a tracer (each write taking at least ``write_s``): ``spans`` holds the
    (start, end, offset) of every write, ``most`` the most writes seen at once."""

    def __init__(self, monkeypatch, write_s: float):
        self.spans, self.most, self._running, self._lock = [], 0, 0, threading.Lock()
        self._real, self._write_s = os.pwrite, write_s
        self.first = threading.Event()
        monkeypatch.setattr(os, "pwrite", self._traced)

    def _traced(self, fd, data, offset):
        with self._lock:
            self._running += 1
            self.most = max(self.most, self._running)
        start = time.monotonic()
        time.sleep(self._write_s)
        n = self._real(fd, data, offset)
        with self._lock:
            self._running -= 1
            self.spans.append((start, time.monotonic(), offset))
        self.first.set()
        return n

    def gaps_s(self) -> list[float]:
        spans = sorted(self.spans)
        return [b[0] - a[1] for a, b in zip(spans, spans[1:])]


def _write_blocks(tmp_path, pace: Pace | None, blocks: int = 8) -> None:
    """``blocks`` blocks of 16 KiB through a direct sink (page cache) of ``pace``; checks what it wrote."""
    data = os.urandom(blocks * 4 * ALIGN_BYTES)
    path = tmp_path / f"f{id(pace)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sink = open_direct_sink(fd, BlockHasher(ALIGN_BYTES), mode=WriteMode(o_direct=False, pace=pace))
        if sink is None:
            pytest.skip("built without the C writer")
        sink.write_many([memoryview(data)])
        sink.close()
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert sink.source_record() == sink.hasher.finish()


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(knobs, "DIRECT_IO_BLOCK_BYTES", 4 * ALIGN_BYTES)
    monkeypatch.setattr(knobs, "DIRECT_IO_QUEUE_DEPTH", 4)


def test_a_paced_writer_writes_one_block_at_a_time_in_order_and_rests_between(tmp_path, monkeypatch,
                                                                                small_blocks):
    traced = _TracedWrites(monkeypatch, write_s=0.02)
    _write_blocks(tmp_path, Pace(0.5))
    spans, most = traced.spans, traced.most
    assert most == 1
    assert [offset for _, _, offset in spans] == sorted(offset for _, _, offset in spans)
    # At share 0.5 the writer rests at least as long as each write took before it starts the next.
    for (start, end, _), (next_start, _, _) in zip(spans, spans[1:]):
        assert next_start - end >= 0.9 * (end - start)


def test_an_unpaced_writer_keeps_its_queue_of_writers(tmp_path, monkeypatch, small_blocks):
    traced = _TracedWrites(monkeypatch, write_s=0.02)
    _write_blocks(tmp_path, None)
    assert len(traced.spans) == 8 and traced.most > 1


#: A pace whose rests last 99x the write: 2 s after each 20 ms write, had hurry() not cut them short.
CRAWL = 0.01


def test_hurry_ends_the_rests_of_a_writer_in_the_middle_of_a_file(tmp_path, monkeypatch, small_blocks):
    traced = _TracedWrites(monkeypatch, write_s=0.02)
    pace = Pace(CRAWL)
    hurried = threading.Thread(target=lambda: (traced.first.wait(), pace.hurry()))
    hurried.start()
    _write_blocks(tmp_path, pace)
    hurried.join()
    assert len(traced.spans) == 8 and max(traced.gaps_s()) < 1.0  # a rest would have been >= 1.98 s
    _write_blocks(tmp_path, pace)   # a file opened after hurry() starts at full speed
    assert traced.most > 1


def test_waiting_on_a_background_save_lifts_its_pace(tmp_path, monkeypatch, small_blocks):
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", CRAWL)
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)   # the traced pwrite sees plain writes
    traced = _TracedWrites(monkeypatch, write_s=0.02)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}   # 4 MiB: 256 blocks of 16 KiB
    future = ck.async_save(state, str(tmp_path / "a"))
    traced.first.wait()
    future.wait()
    assert max(traced.gaps_s()) < 1.0   # a rest would have been >= 1.98 s
    out = {"w": torch.zeros(1 << 20)}
    ck.load(out, str(tmp_path / "a"))
    assert torch.equal(out["w"], state["w"])


def test_only_a_wait_that_blocks_asks_the_save_to_hurry():
    asked = []
    future = CheckpointFuture("/ckpt/a", hurry=lambda: asked.append(1))
    with pytest.raises(AsyncWaitTimeout):
        future.wait(timeout=0)          # a poll: the caller goes on training
    assert not future.wait_finished(0)
    assert asked == []
    assert not future.wait_finished(0.01)
    assert asked == [1]
    assert not future.wait_finished(0.01, hurry=False)   # a watcher while training goes on
    with pytest.raises(AsyncWaitTimeout):
        future.wait(0.01, hurry=False)
    assert asked == [1]
    future.finish()
    future.wait()
    future.hurry()
    assert asked == [1]                 # done: nothing left to hurry


def test_paced_for_at_most_lifts_the_pace_after_its_time_and_cancels_when_the_block_ends():
    late, early = WriteMode(pace=Pace(0.5)), WriteMode(pace=Pace(0.5))
    with late.paced_for_at_most(0.05):
        late.pace._hurried.wait(30)          # the timer's hurry() sets it
    assert late.pace.share == 1.0
    with early.paced_for_at_most(0.2):
        pass                                 # the write ended first: the timer is cancelled
    time.sleep(0.4)
    assert early.pace.share == 0.5
    with FOREGROUND.paced_for_at_most(0.0), WriteMode(pace=Pace(0.5)).paced_for_at_most(None):
        pass                                 # no pace, or no limit: nothing to do
    forever = WriteMode(pace=Pace(0.5))
    with forever.paced_for_at_most(timedelta.max.total_seconds()):   # a group that never times out
        pass
    assert forever.pace.share == 0.5


def _crawling_save_on_a_group_with_a_short_deadline(rank, world_size, root):
    from datetime import timedelta

    import torch.distributed as dist

    knobs.DIRECT_IO_BLOCK_BYTES = 1 << 20
    knobs.BACKGROUND_DISK_SHARE = 1e-4       # rests of ~10^4 times each 1 MiB block: minutes per file
    group = dist.new_group(ranks=list(range(world_size)), timeout=timedelta(seconds=8))
    state = {"w": torch.arange(4 << 20, dtype=torch.float32)}   # 16 MiB, replicated
    future = ck.async_save(state, root, group=group)
    future.wait(timeout=120, hurry=False)    # nobody hurries it: the group's deadline does, after 2 s
    out = {"w": torch.zeros(4 << 20)}
    ck.load(out, root, group=group)
    return torch.equal(out["w"], state["w"])


def test_a_multi_rank_background_save_is_paced_for_at_most_a_quarter_of_its_group_s_timeout(tmp_path):
    from ranks import run_ranks

    assert run_ranks(_crawling_save_on_a_group_with_a_short_deadline, 2, tmp_path, str(tmp_path / "ck")) == [True, True]

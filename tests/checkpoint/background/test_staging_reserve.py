"""``AsyncCheckpointer.prepare(state, background=True)``: staging buffers allocated and faulted in ahead.

What a caller relies on: ``prepare`` returns at once; the next save uses the
reserved buffers and holds the values of *its* moment (never those of
``prepare``'s); a save that comes before the reserve has finished stops it
and faults the rest itself; a state whose shapes changed since ``prepare``,
a reserve that failed, or one never used (``close()``) all leave saves
correct; buffers the reserve finished are not faulted again by the save.
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

from shardkit import knobs
from shardkit.checkpoint import AsyncCheckpointer, ShardMetadata, load_distributed
import shardkit.checkpoint.background.staging as staging
from shardkit.checkpoint.background.staging_reserve import StagingReserve
from shardkit.errors import AsyncCheckpointError
from shardkit.storage.fast_io.prefault import PAGE_BYTES

import shardkit.checkpoint.background.checkpointer as async_save
import shardkit.checkpoint.background.staging_reserve as staging_reserve
SPEC = ShardMetadata(num_ranks=1, tensor_specs={})


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 257, generator=g), "b": torch.randn(7, generator=g),
                      "h": torch.randn(1000, 33, generator=g).to(torch.bfloat16), "empty": torch.ones(0, 3)},
            "optim": [{"m": torch.randn(70_000, generator=g), "step": 3}], "scalar": torch.tensor(2.5)}


def _leaves(node, prefix=()):
    if isinstance(node, torch.Tensor):
        return {prefix: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return {k: v for key, child in items for k, v in _leaves(child, prefix + (key,)).items()}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 16 * PAGE_BYTES)


@pytest.fixture
def fake_write(monkeypatch):
    calls = []
    monkeypatch.setattr(async_save, "_save_staged", lambda staged, *a, **k: calls.append(staged))
    return calls


class GatedPopulate:
    """Stands in for the reserve's ``populate_for_write``: every call waits for ``gate``, and is counted."""

    def __init__(self, monkeypatch, real=staging_reserve.populate_for_write):
        self.gate, self.calls, self.entered = threading.Event(), 0, threading.Event()
        self.real = real
        monkeypatch.setattr(staging_reserve, "populate_for_write", self)

    def __call__(self, addr, nbytes):
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(30)
        return self.real(addr, nbytes)


def test_the_first_save_uses_the_reserved_buffers_and_holds_its_own_moment(fake_write, small_chunks, tmp_path):
    state = _state()
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(state, background=True)
    assert ckpt._reserve._done.wait(30)
    reserved = {path: buf.data_ptr() for path, buf in ckpt._reserve._buffers.items()}
    assert set(reserved) == set(_leaves(state))
    for t in _leaves(state).values():
        t.add_(1)  # training between prepare and the save
    expect = {path: t.clone() for path, t in _leaves(state).items()}
    ckpt.save_async(state).wait()
    staged = _leaves(fake_write[0])
    for path, t in expect.items():
        assert torch.equal(staged[path], t), path
        assert staged[path].data_ptr() == reserved[path] or t.numel() == 0, path
    ckpt.close()


def test_a_finished_reserve_is_not_faulted_again_by_the_save(fake_write, small_chunks, monkeypatch, tmp_path):
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(_state(), background=True)
    assert ckpt._reserve._done.wait(30)
    assert ckpt._reserve._unfaulted == set()
    faults = []
    monkeypatch.setattr(staging, "populate_for_write", lambda a, n: faults.append(n) or True)
    ckpt.save_async(_state(1)).wait()
    assert faults == []
    ckpt.close()


def test_a_save_before_the_reserve_finished_stops_it_and_faults_the_rest(fake_write, small_chunks, monkeypatch,
                                                                          tmp_path):
    gated = GatedPopulate(monkeypatch)
    faults = []
    real = staging.populate_for_write
    monkeypatch.setattr(staging, "populate_for_write", lambda a, n: faults.append(n) or real(a, n))
    state = _state(2)
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(state, background=True)  # returns while the reserve waits in its first fault
    assert gated.entered.wait(30)
    reserve = ckpt._reserve
    threading.Timer(0.2, gated.gate.set).start()  # the save stops it; it finishes the chunk in hand
    ckpt.save_async(state).wait()
    assert reserve.done and gated.calls == 1
    assert faults, "the save faulted in what the reserve had not reached"
    staged = _leaves(fake_write[0])
    for path, t in _leaves(state).items():
        assert torch.equal(staged[path], t), path
    ckpt.close()


def test_changed_shapes_and_a_failed_reserve_still_save_the_right_values(fake_write, monkeypatch, tmp_path):
    calls = {"n": 0}
    real = staging_reserve.buffer_for

    def fails_on_the_third(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("out of host memory (test)")
        return real(*a, **k)

    monkeypatch.setattr(staging_reserve, "buffer_for", fails_on_the_third)
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(_state(), background=True)
    assert ckpt._reserve._done.wait(30)
    assert len(ckpt._reserve._buffers) == 2  # stopped at the failure, raised nothing
    state = _state(3)
    state["model"]["w"] = torch.randn(20, 4)  # another shape than the reserve's
    ckpt.save_async(state).wait()
    staged = _leaves(fake_write[0])
    for path, t in _leaves(state).items():
        assert torch.equal(staged[path], t), path
    ckpt.close()


def test_background_prepare_is_refused_while_a_save_is_in_flight_and_after_close(monkeypatch, tmp_path):
    gate = threading.Event()
    monkeypatch.setattr(async_save, "_save_staged", lambda *a, **k: gate.wait(30))
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.save_async(_state())
    with pytest.raises(AsyncCheckpointError, match="in flight"):
        ckpt.prepare(_state(), background=True)
    gate.set()
    ckpt.close()
    with pytest.raises(AsyncCheckpointError, match="closed"):
        ckpt.prepare(_state(), background=True)


def test_close_stops_an_unused_reserve(monkeypatch, tmp_path):
    gated = GatedPopulate(monkeypatch)
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(_state(), background=True)
    reserve = ckpt._reserve
    assert gated.entered.wait(30)
    threading.Timer(0.1, gated.gate.set).start()
    ckpt.close()
    assert reserve.done and gated.calls == 1 and ckpt._reserve is None


def test_a_second_background_prepare_replaces_the_first_and_keeps_fitting_buffers(fake_write, tmp_path):
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.prepare(_state(), background=True)
    first = ckpt._reserve
    ckpt.prepare(_state(), background=True)
    assert first.done
    assert ckpt._reserve._done.wait(30)
    second = ckpt._reserve.take()[0]
    assert all(second[path] is buf for path, buf in first._buffers.items())
    ckpt.close()


def test_a_real_save_after_a_background_prepare_loads_back(small_chunks, tmp_path):
    state = {"w": torch.randn(64, 129), "nested": {"v": torch.arange(5000, dtype=torch.int64)}}
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC) as ckpt:
        ckpt.prepare(state, background=True)
        state["w"].mul_(3)
        expect = {k: v.clone() for k, v in _leaves(state).items()}
        ckpt.save_async(state)
        state["w"].zero_()  # after the call returned: not in the checkpoint
    loaded = load_distributed(tmp_path / "ck", 0, 1)
    assert torch.equal(loaded["w"], expect[("w",)])
    assert torch.equal(loaded["nested"]["v"], expect[("nested", "v")])


def test_the_reserve_keeps_buffers_that_fit_and_faults_only_new_ones(small_chunks, monkeypatch):
    gated = GatedPopulate(monkeypatch)
    gated.gate.set()
    kept = torch.empty(1000)
    reserve = StagingReserve({"w": torch.ones(1000), "v": torch.ones(2, 30_000), "x": torch.ones(5)},
                             {("w",): kept, ("v",): torch.empty(30_000, 2)})  # "v" no longer fits
    assert reserve._done.wait(30)
    buffers, unfaulted = reserve.take()
    assert buffers[("w",)] is kept and buffers[("v",)].shape == (2, 30_000) and buffers[("x",)].shape == (5,)
    assert gated.calls == 4  # "v": 240,000 bytes in chunks of 16 pages; "x" holds no page; "w" is kept
    assert unfaulted == set()


# --- CheckpointManager.prepare (the engine's background saves) ------------------------------

def test_manager_prepare_makes_the_buffers_the_first_save_copies_into(tmp_path, small_chunks):
    api = importlib.import_module("shardkit.checkpoint.api")
    from shardkit.checkpoint import CheckpointManager

    state = {"model": {"w": torch.randn(64, 129), "b": torch.zeros(3)}, "step": 0}
    with CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        assert mgr.restore(state) is None
        mgr.prepare(state)
        reserve = api._RESERVES[api._key(mgr._background)]
        assert reserve._done.wait(30)
        reserved = {path: buf.data_ptr() for path, buf in reserve._buffers.items()}
        state["model"]["w"].add_(1)
        expect = state["model"]["w"].clone()
        mgr.save(1, state)
        state["model"]["w"].zero_()  # after save() returned: not in step 1
        mgr.wait()
        used = api._STAGING[api._key(mgr._background)]
        assert {path: buf.data_ptr() for path, buf in used.items()} == reserved
    fresh = {"model": {"w": torch.empty(64, 129), "b": torch.ones(3)}, "step": -1}
    assert CheckpointManager(tmp_path / "run").restore(fresh) == 1
    assert torch.equal(fresh["model"]["w"], expect) and fresh["step"] == 0


def test_manager_prepare_is_a_no_op_for_blocking_saves_and_refused_once_closed(tmp_path):
    from shardkit.checkpoint import CheckpointManager
    from shardkit.errors import CheckpointError

    mgr = CheckpointManager(tmp_path / "run", async_save=False)
    mgr.prepare({"w": torch.ones(4)})
    assert mgr._background is None
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.prepare({"w": torch.ones(4)})


def _prepare_then_save_on_ranks(rank, world_size, root):
    from shardkit.checkpoint import CheckpointManager

    state = {"w": torch.arange(4000.0), "v": torch.full((300,), 2.0)}  # replicated: each rank writes a part
    with CheckpointManager(root, group=torch.distributed.group.WORLD) as mgr:
        mgr.restore(state)
        mgr.prepare(state, rank_state={"rank": torch.tensor([rank])})
        mgr.save(5, state, rank_state={"rank": torch.tensor([rank])})
        state["w"].zero_()
    return True


def test_manager_prepare_on_two_ranks_then_restore_on_one(tmp_path):
    from ranks import run_ranks
    from shardkit.checkpoint import CheckpointManager

    assert run_ranks(_prepare_then_save_on_ranks, 2, tmp_path, str(tmp_path / "run")) == [True, True]
    state = {"w": torch.empty(4000), "v": torch.empty(300)}
    assert CheckpointManager(tmp_path / "run").restore(state) == 5
    assert torch.equal(state["w"], torch.arange(4000.0)) and torch.equal(state["v"], torch.full((300,), 2.0))


# --- what a review found (each failed on the first version) ---------------------------------

def test_a_late_reserve_hands_back_the_warm_buffers_it_had_not_reached(fake_write, small_chunks, monkeypatch,
                                                                      tmp_path):
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    state = {"grown": torch.ones(1000), "warm": torch.ones(5000)}
    ckpt.save_async(state).wait()
    warm = ckpt._buffers[("warm",)]
    gated = GatedPopulate(monkeypatch)
    state["grown"] = torch.ones(100_000)  # reached first: a new buffer, its faulting held at the gate
    ckpt.prepare(state, background=True)
    assert gated.entered.wait(30)
    threading.Timer(0.1, gated.gate.set).start()
    ckpt.save_async(state).wait()  # stops the reserve before it reached "warm"
    assert fake_write[-1]["warm"].data_ptr() == warm.data_ptr()
    ckpt.close()


def test_a_background_prepare_holds_one_copy_not_two(fake_write, tmp_path):
    import gc
    import weakref

    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.save_async({"w": torch.ones(4096)}).wait()
    old = weakref.ref(ckpt._buffers[("w",)])
    ckpt.prepare({"w": torch.ones(8192)}, background=True)  # another shape: the old buffer is not reused
    assert ckpt._reserve._done.wait(30)
    fake_write.clear()  # the fake writer's record of the first save
    gc.collect()
    assert old() is None and ckpt._buffers == {}
    ckpt.close()


def test_close_interrupted_while_stopping_the_reserve_still_frees_the_buffers(fake_write, monkeypatch, tmp_path):
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    ckpt.save_async({"v": torch.ones(4096)}).wait()  # buffers kept
    ckpt.prepare({"w": torch.ones(4096)}, background=True)
    reserve = ckpt._reserve
    real_take = reserve.take

    def interrupted():
        real_take()
        raise KeyboardInterrupt

    monkeypatch.setattr(reserve, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.close()
    assert ckpt._closed and ckpt._reserve is None and ckpt._buffers == {}


def test_close_on_another_thread_waits_for_a_prepare_in_progress_and_stops_its_reserve(tmp_path):
    entered, gate = threading.Event(), threading.Event()

    class SlowState(dict):  # its walk blocks, as a large state's would take long
        def items(self):
            entered.set()
            assert gate.wait(30)
            return super().items()

    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, SPEC)
    preparing = threading.Thread(target=ckpt.prepare, args=(SlowState(w=torch.ones(4096)),),
                                 kwargs={"background": True})
    preparing.start()
    assert entered.wait(30)
    closing = threading.Thread(target=ckpt.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive(), "close() must wait for prepare(), which holds the checkpointer"
    gate.set()
    preparing.join(30)
    closing.join(30)
    assert ckpt._closed and ckpt._reserve is None and ckpt._buffers == {}


def test_manager_prepare_that_cannot_start_its_thread_is_typed_and_keeps_the_buffers(tmp_path, monkeypatch):
    api = importlib.import_module("shardkit.checkpoint.api")
    from shardkit.checkpoint import CheckpointManager

    state = {"w": torch.ones(4096)}
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, state)
        mgr.wait()
        key = api._key(mgr._background)
        kept = api._STAGING[key]

        def no_thread(*args, **kwargs):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(api, "StagingReserve", no_thread)
        with pytest.raises(AsyncCheckpointError, match="can't start new thread"):
            mgr.prepare(state)
        assert api._STAGING[key] is kept


def test_a_kept_buffer_of_a_leaf_the_state_no_longer_has_is_dropped():
    kept = {("gone",): torch.empty(16), ("w",): torch.empty(8)}
    buffers, _ = StagingReserve({"w": torch.ones(8)}, kept).take()
    assert set(buffers) == {("w",)} and buffers[("w",)] is kept[("w",)]

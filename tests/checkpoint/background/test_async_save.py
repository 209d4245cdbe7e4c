"""AsyncCheckpointer / CheckpointFuture: staging, one save in flight, failures, waits.

The first half replaces the write with a fake (``_save_staged``) to pin down
the future's semantics without disk I/O; the second half saves for real with
``save_distributed`` and loads the result back.
"""

from __future__ import annotations

import os
import threading


import pytest
import torch

import shardkit.checkpoint.background.checkpointer as async_save
from shardkit.checkpoint.background.checkpointer import AsyncCheckpointer, AsyncWaitTimeout, CheckpointFuture
from shardkit.errors import AsyncCheckpointError, CheckpointError


class FakeSave:
    """Records what the background thread was given; can block or fail on demand."""

    def __init__(self):
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_with: BaseException | None = None

    def __call__(self, staged, dir, rank, world_size, shard_spec, group, *, overwrite=False, mode=None):
        self.calls.append({"staged": staged, "dir": dir, "thread": threading.current_thread().name,
                           "overwrite": overwrite})
        assert self.gate.wait(30)
        if self.fail_with is not None:
            raise self.fail_with


@pytest.fixture
def fake(monkeypatch):
    f = FakeSave()
    monkeypatch.setattr(async_save, "_save_staged", f)
    return f


def _ckpt(tmp_path, **kw):
    return AsyncCheckpointer(tmp_path / "ck", 0, 1, None, **kw)


def test_save_returns_before_the_write_and_wait_completes_it(fake, tmp_path):
    fake.gate.clear()
    ckpt = _ckpt(tmp_path)
    future = ckpt.save_async({"w": torch.ones(3)})
    assert isinstance(future, CheckpointFuture)
    assert not future.done()
    fake.gate.set()
    future.wait()
    future.wait()  # idempotent
    assert future.done()
    assert fake.calls[0]["thread"].startswith("shardkit-async-save")
    assert fake.calls[0]["dir"] == os.fspath(tmp_path / "ck")


def test_second_save_while_in_flight_is_refused_with_advice(fake, tmp_path):
    fake.gate.clear()
    ckpt = _ckpt(tmp_path)
    first = ckpt.save_async({"w": torch.ones(3)})
    with pytest.raises(AsyncCheckpointError, match=r"still in flight.*wait\(\)"):
        ckpt.save_async({"w": torch.ones(3)}, dir=tmp_path / "other")
    fake.gate.set()
    first.wait()
    ckpt.save_async({"w": torch.ones(3)}, dir=tmp_path / "other").wait()
    assert [c["dir"] for c in fake.calls] == [os.fspath(tmp_path / "ck"), os.fspath(tmp_path / "other")]


def test_failure_is_raised_by_every_wait_chained_and_a_new_save_is_accepted(fake, tmp_path):
    cause = OSError(28, "No space left on device")
    fake.fail_with = cause
    ckpt = _ckpt(tmp_path)
    future = ckpt.save_async({"w": torch.ones(3)})
    for _ in range(2):
        with pytest.raises(AsyncCheckpointError, match="No space left") as info:
            future.wait()
        assert info.value.__cause__ is cause
    assert future.done()
    fake.fail_with = None
    ckpt.save_async({"w": torch.ones(3)}).wait()
    ckpt.close()  # the failure was already reported: close does not raise it again


def test_wait_timeout_is_a_timeout_error_and_keeps_the_future(fake, tmp_path):
    fake.gate.clear()
    future = _ckpt(tmp_path).save_async({"w": torch.ones(3)})
    with pytest.raises(TimeoutError, match="still running") as info:
        future.wait(timeout=0.05)
    assert isinstance(info.value, AsyncWaitTimeout) and isinstance(info.value, CheckpointError)
    assert not isinstance(info.value, AsyncCheckpointError)  # nothing failed
    fake.gate.set()
    future.wait(timeout=30)
    assert future.done() and future.duration_s is not None


def test_staged_copy_is_a_snapshot_of_nested_state(fake, tmp_path):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nt = torch.arange(12, dtype=torch.int64).reshape(4, 3).t()  # non-contiguous
    state = {"model": {"w": w, "nt": nt}, "optim": {"state": [{"m": w * 2, "step": 5}]}, "tag": "x", "n": None}
    expect = {"w": w.clone(), "nt": nt.clone(), "m": w * 2}
    ckpt = _ckpt(tmp_path)
    future = ckpt.save_async(state)
    w.add_(100)
    nt.mul_(-1)
    state["optim"]["state"][0]["m"].zero_()
    state["model"]["w"] = torch.zeros(1)      # rebinding in the caller's dict does not leak in either
    state["optim"]["state"].append("late")
    future.wait()
    staged = fake.calls[0]["staged"]
    assert torch.equal(staged["model"]["w"], expect["w"])
    assert torch.equal(staged["model"]["nt"], expect["nt"]) and staged["model"]["nt"].is_contiguous()
    assert torch.equal(staged["optim"]["state"][0]["m"], expect["m"])
    assert staged["optim"]["state"][0]["step"] == 5 and len(staged["optim"]["state"]) == 1
    assert staged["tag"] == "x" and staged["n"] is None
    assert staged["model"]["w"].data_ptr() != w.data_ptr()


def test_staging_buffers_are_reused_when_shapes_match(fake, tmp_path):
    ckpt = _ckpt(tmp_path)
    state = {"a": torch.ones(64), "b": torch.ones(8, dtype=torch.bfloat16)}
    ckpt.save_async(state).wait()
    first = {k: t.data_ptr() for k, t in fake.calls[0]["staged"].items()}
    state["a"].fill_(2)
    state["b"] = torch.ones(9, dtype=torch.bfloat16)  # new shape: new buffer
    ckpt.save_async(state).wait()
    second = fake.calls[1]["staged"]
    assert second["a"].data_ptr() == first["a"] and torch.equal(second["a"], torch.full((64,), 2.0))
    assert second["b"].shape == (9,)


def test_without_reuse_no_buffers_are_kept(fake, tmp_path):
    ckpt = _ckpt(tmp_path, reuse_buffers=False)
    state = {"a": torch.ones(1 << 16)}
    for _ in range(2):
        ckpt.save_async(state).wait()
        assert ckpt._buffers == {}
    assert all(torch.equal(c["staged"]["a"], state["a"]) for c in fake.calls)


def test_staging_failure_raises_at_once_ends_the_writer_and_frees_the_slot(fake, tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path)

    def boom(state, buffers, *args, **kwargs):
        raise MemoryError("host memory exhausted")

    monkeypatch.setattr(async_save, "stage", boom)
    with pytest.raises(AsyncCheckpointError, match="staging.*host memory exhausted"):
        ckpt.save_async({"w": torch.ones(2)})
    assert fake.calls == []  # no group: the background engine was never started for it
    monkeypatch.undo()
    monkeypatch.setattr(async_save, "_save_staged", fake)
    ckpt.save_async({"w": torch.ones(2)}).wait()
    assert len(fake.calls) == 1


def test_close_and_context_manager_wait_for_the_save(fake, tmp_path):
    fake.gate.clear()
    with _ckpt(tmp_path) as ckpt:
        future = ckpt.save_async({"w": torch.ones(2)})
        threading.Timer(0.1, fake.gate.set).start()
    assert future.done()
    with pytest.raises(AsyncCheckpointError, match="closed"):
        ckpt.save_async({"w": torch.ones(2)})
    ckpt.close()  # idempotent


def test_close_raises_an_unreported_failure(fake, tmp_path):
    fake.fail_with = RuntimeError("disk went away")
    ckpt = _ckpt(tmp_path)
    ckpt.save_async({"w": torch.ones(2)})
    with pytest.raises(AsyncCheckpointError, match="disk went away"):
        ckpt.close()


def test_a_group_unknown_to_torch_distributed_is_refused_with_advice(tmp_path):
    with pytest.raises(AsyncCheckpointError, match="dedicated_group=False"):
        AsyncCheckpointer(tmp_path, 0, 1, None, group=object())


def test_unsavable_leaf_is_refused_at_save_async_not_in_the_background(fake, tmp_path):
    ckpt = _ckpt(tmp_path)
    with pytest.raises(AsyncCheckpointError, match="never pickles") as info:
        ckpt.save_async({"w": torch.ones(2), "opt": object()})
    assert isinstance(info.value.__cause__, TypeError)
    assert fake.calls == []
    ckpt.save_async({"w": torch.ones(2)}).wait()


def test_prepare_allocates_the_buffers_the_first_save_reuses(fake, tmp_path):
    ckpt = _ckpt(tmp_path)
    state = {"a": torch.arange(10.0)}
    ckpt.prepare(state)
    ptr = ckpt._buffers[("a",)].data_ptr()
    ckpt.save_async(state).wait()
    assert fake.calls[0]["staged"]["a"].data_ptr() == ptr
    fake.gate.clear()
    ckpt.save_async(state)
    with pytest.raises(AsyncCheckpointError, match="in flight"):
        ckpt.prepare(state)
    fake.gate.set()
    ckpt.close()


# --- real saves (save_distributed, then load) ------------------------------------------

from shardkit.checkpoint import (  # noqa: E402
    ShardMetadata,
    TensorShardSpec,
    load_distributed,
    validate_distributed,
)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_checkpoint_holds_the_values_at_save_async_while_training_mutates(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    half = torch.randn(33, 7, generator=g).to(torch.bfloat16)
    state = {"model": {"w": w, "h": half.t()}, "optim": {"state": [{"m": torch.zeros(5), "step": 7}]}}
    originals = {"w": w.clone(), "h": half.t().clone(), "m": torch.zeros(5)}
    spec = ShardMetadata(1, {"model.w": TensorShardSpec((256, 64), 0, (256,))})
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, spec) as ckpt:
        future = ckpt.save_async(state)
        for _ in range(20):  # "training": in-place updates right after save_async
            w.mul_(0.5).add_(1)
            half.add_(1)
            state["optim"]["state"][0]["m"].add_(3)
        state["optim"]["state"][0]["step"] = 8
        future.wait()
    assert validate_distributed(tmp_path / "ck").ok
    out = load_distributed(tmp_path / "ck", 0, 1)
    assert torch.equal(_bits(out["model"]["w"]), _bits(originals["w"]))
    assert torch.equal(_bits(out["model"]["h"]), _bits(originals["h"]))
    assert torch.equal(out["optim"]["state"][0]["m"], originals["m"])
    assert out["optim"]["state"][0]["step"] == 7


def test_repeated_saves_to_new_dirs_each_hold_their_step(tmp_path):
    w = torch.zeros(1000)
    with AsyncCheckpointer(tmp_path / "unused", 0, 1, None) as ckpt:
        futures = []
        for step in range(4):
            if futures:
                futures[-1].wait()
            futures.append(ckpt.save_async({"w": w, "step": step}, dir=tmp_path / f"step-{step}"))
            w.add_(1)
    for step in range(4):
        out = load_distributed(tmp_path / f"step-{step}", 0, 1)
        assert out["step"] == step and torch.equal(out["w"], torch.full((1000,), float(step)))


def test_background_failure_surfaces_in_wait_and_the_next_save_works(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"a file where the checkpoint directory should go")
    ckpt = AsyncCheckpointer(blocker / "ck", 0, 1, None)
    future = ckpt.save_async({"w": torch.ones(3)})
    with pytest.raises(AsyncCheckpointError, match="failed") as info:
        future.wait(timeout=30)
    assert isinstance(info.value.__cause__, OSError), repr(info.value.__cause__)
    assert str(blocker / "ck") in str(info.value)
    with pytest.raises(AsyncCheckpointError):
        future.wait()
    ckpt.save_async({"w": torch.ones(3)}, dir=tmp_path / "ok").wait()
    ckpt.close()
    assert torch.equal(load_distributed(tmp_path / "ok", 0, 1)["w"], torch.ones(3))


def test_spec_mismatch_fails_in_wait_with_the_cores_message(tmp_path):
    spec = ShardMetadata(1, {"w": TensorShardSpec((4,), 0, (4,))})
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, spec)
    future = ckpt.save_async({"w": torch.ones(5)})
    with pytest.raises(AsyncCheckpointError, match="shape") as info:
        future.wait()
    assert isinstance(info.value.__cause__, ValueError)
    assert not validate_distributed(tmp_path / "ck").ok


# --- shardkit comm.Group --------------------------------------------------------------


def _in_threads(fn, groups):
    out, errors = [None] * len(groups), []

    def run(i, g):
        try:
            out[i] = fn(g)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_a_shardkit_group_is_split_into_a_dedicated_one_and_closed_with_the_checkpointer(fake, tmp_path):
    from shardkit.comm import Group

    groups = Group.local(2)
    try:
        ckpts = _in_threads(lambda g: AsyncCheckpointer(tmp_path, g.rank, 2, None, group=g), groups)
        for g, c in zip(groups, ckpts):
            assert c.group is not g and c.group.world_size == 2 and c.group.rank == g.rank
        _in_threads(lambda c: c.save_async({"w": torch.ones(1)}).wait(), ckpts)
        assert [c["staged"]["w"].item() for c in fake.calls] == [1.0, 1.0]
        own = [c.group for c in ckpts]
        for c in ckpts:
            c.close()
        assert all("closed" in repr(g) for g in own)
    finally:
        for g in groups:
            g.close()


def test_real_async_save_over_a_shardkit_group(tmp_path):
    from shardkit.comm import Group

    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    groups = Group.local(2)
    try:
        def save(g):
            with AsyncCheckpointer(tmp_path / "ck", g.rank, 2, spec, group=g) as ckpt:
                ckpt.save_async({"w": torch.full((2,), float(g.rank))}).wait(timeout=60)

        _in_threads(save, groups)
    finally:
        for g in groups:
            g.close()
    assert torch.equal(load_distributed(tmp_path / "ck", 0, 1)["w"], torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_host_copier_chunks_and_falls_back_bit_exact(monkeypatch):
    from shardkit import knobs

    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 1000)  # many chunks, spread over the pool
    monkeypatch.setattr(knobs, "IO_THREADS", 3)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(40, 300, generator=g)
    state = {
        "big": big,
        "offset_view": big[7:19],                     # storage offset, contiguous
        "strided": big[:, ::3],                       # non-contiguous: copy_ fallback
        "bf16": torch.randn(1234, generator=g).to(torch.bfloat16),
        "bool": torch.rand(999, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (3001,), generator=g, dtype=torch.int8),
        "zero_d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "conj": torch.randn(10, generator=g, dtype=torch.complex64).conj(),  # lazy conj bit: copy_ fallback
    }
    staged, _ = async_save.stage(state, {})
    for name, t in state.items():
        got = staged[name]
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous(), name
        assert torch.equal(got.resolve_conj(), t.resolve_conj()), name
        assert got.numel() == 0 or got.data_ptr() != t.data_ptr(), name


@pytest.mark.parametrize("threads", [1, 3])
def test_host_copier_copies_every_byte_of_mixed_sizes(monkeypatch, threads):
    from shardkit import knobs
    from shardkit.checkpoint.background.staging import copy_host

    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 4096)
    monkeypatch.setattr(knobs, "IO_THREADS", threads)
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen) for n in (0, 1, 100, 4095, 4096, 4097, 50_000)]
    srcs += [torch.randn(33, 17, generator=gen).t(), torch.randn(3, generator=gen).to(torch.bfloat16)]  # non-contiguous, bf16
    dsts = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in srcs]
    copy_host(list(zip(dsts, srcs)))
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)

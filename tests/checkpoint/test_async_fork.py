"""AsyncCheckpointer(snapshot="fork"): a forked child writes a copy-on-write image of the state.

Real saves and loads, bit for bit: the checkpoint holds the values of the
moment ``save_async`` returned, failures in the child reach ``wait()``
with their cause, and states a fork cannot capture are copied instead.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardkit.checkpoint import AsyncCheckpointer, ShardMetadata, TensorShardSpec, load_distributed, validate_distributed
from shardkit.checkpoint import save as save_module
from shardkit.checkpoint.snapshot import ForkSnapshot, fork_supported
from shardkit.errors import AsyncCheckpointError, CheckpointError
from tests.hf.hf_helpers import mixed_state
from tests.state_leaves import leaves

pytestmark = pytest.mark.skipif(not fork_supported(), reason="fork snapshots are Linux-only")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _clone(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_the_checkpoint_holds_the_values_of_save_async_while_training_writes_in_place(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 256, generator=g)
    half = torch.randn(33, 7, generator=g).to(torch.bfloat16)
    state = {"model": {"w": w, "h": half.t(), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)},
             "optim": [{"m": torch.zeros(5), "step": 7}]}
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in leaves(state).items()}
    spec = ShardMetadata(1, {"model.w": TensorShardSpec((512, 256), 0, (512,))})
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, spec, snapshot="fork") as ckpt:
        future = ckpt.save_async(state)
        assert future.snapshot == "fork"
        for _ in range(10):  # training goes on at once
            w.mul_(0.5).add_(1)
            half.add_(1)
            state["model"]["scalar"].add_(1)
            state["optim"][0]["m"].add_(3)
        state["optim"][0]["step"] = 8
        future.wait(timeout=60)
    assert validate_distributed(tmp_path / "ck").ok
    after = leaves(load_distributed(tmp_path / "ck", 0, 1))
    assert set(after) == set(before)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert after[name].dtype == value.dtype and after[name].shape == value.shape, name
            assert torch.equal(_bits(after[name]), _bits(value)), name
        else:
            assert after[name] == value, name


def test_every_dtype_a_scalar_and_an_empty_tensor_round_trip(tmp_path):
    state = mixed_state()  # one tensor of each dtype shardkit saves
    want = _clone(state)
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="fork") as ckpt:
        ckpt.save_async(state).wait(timeout=60)
    out = load_distributed(tmp_path / "ck", 0, 1)
    for name, t in want.items():
        assert torch.equal(_bits(out[name]), _bits(t)), name


def test_repeated_saves_each_hold_their_step_and_allocate_no_buffers(tmp_path):
    w = torch.zeros(1000)
    with AsyncCheckpointer(tmp_path / "unused", 0, 1, None, snapshot="fork") as ckpt:
        ckpt.prepare({"w": w})
        for step in range(3):
            ckpt.save_async({"w": w, "step": step}, dir=tmp_path / f"s{step}").wait(timeout=60)
            w.add_(1)
        assert ckpt._buffers == {}
    for step in range(3):
        out = load_distributed(tmp_path / f"s{step}", 0, 1)
        assert out["step"] == step and torch.equal(out["w"], torch.full((1000,), float(step)))


def test_shared_memory_is_copied_not_forked(tmp_path):
    shared = torch.arange(10.0).share_memory_()  # a fork would see the parent's later writes
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="fork") as ckpt:
        future = ckpt.save_async({"w": shared})
        shared.add_(100)
        future.wait(timeout=60)
    assert future.snapshot == "copy"
    assert torch.equal(load_distributed(tmp_path / "ck", 0, 1)["w"], torch.arange(10.0))


def test_the_default_is_copy_and_a_bad_mode_is_refused(tmp_path):
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None) as ckpt:
        assert ckpt.save_async({"w": torch.ones(2)}).snapshot == "copy"
    with pytest.raises(ValueError, match="'copy' or 'fork'"):
        AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="cow")


def test_a_child_killed_mid_write_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="fork") as ckpt:
        ckpt.save_async({"w": torch.ones(4), "step": 1}).wait(timeout=60)
        monkeypatch.setattr(save_module, "write_rank_files",
                            lambda *a: os.kill(os.getpid(), signal.SIGKILL))  # runs in the child only
        future = ckpt.save_async({"w": torch.zeros(4), "step": 2}, dir=tmp_path / "next")
        with pytest.raises(AsyncCheckpointError, match="SIGKILL") as info:
            future.wait(timeout=60)
        assert isinstance(info.value.__cause__, CheckpointError)
    assert not validate_distributed(tmp_path / "next").ok
    assert load_distributed(tmp_path / "ck", 0, 1)["step"] == 1


def test_an_error_in_the_child_reaches_wait_with_its_message(tmp_path, monkeypatch):
    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_module, "write_rank_files", fail)
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="fork") as ckpt:
        future = ckpt.save_async({"w": torch.ones(4)})
        with pytest.raises(AsyncCheckpointError, match="No space left on device"):
            future.wait(timeout=60)
        monkeypatch.undo()
        ckpt.save_async({"w": torch.ones(4)}, dir=tmp_path / "ok").wait(timeout=60)  # the next one works
    assert torch.equal(load_distributed(tmp_path / "ok", 0, 1)["w"], torch.ones(4))


def test_a_spec_mismatch_fails_in_wait_without_forking(tmp_path):
    spec = ShardMetadata(1, {"w": TensorShardSpec((4,), 0, (4,))})
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, spec, snapshot="fork") as ckpt:
        future = ckpt.save_async({"w": torch.ones(5)})
        with pytest.raises(AsyncCheckpointError, match="shape"):
            future.wait(timeout=60)


def test_an_unsavable_leaf_is_refused_at_save_async(tmp_path):
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, None, snapshot="fork") as ckpt:
        with pytest.raises(AsyncCheckpointError, match="pickle"):
            ckpt.save_async({"w": torch.ones(1), "f": object()})


def test_fork_snapshot_runs_its_job_once_and_close_sends_the_child_away():
    value = torch.tensor([1.0])
    snap = ForkSnapshot(lambda: value.item())
    value.add_(1)
    assert snap.run() == 1.0
    with pytest.raises(CheckpointError, match="once"):
        snap.run()
    snap.close()
    unused = ForkSnapshot(lambda: 1 / 0)
    unused.close()
    unused.close()
    assert unused._exit_status == 0

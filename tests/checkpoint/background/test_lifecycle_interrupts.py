"""Background saves under interrupts and failures: Ctrl-C while waiting, a failed rotation, metrics a
diverged run reports, a failure nobody waited for, and the background group's deadline."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import shardkit.checkpoint.saving.chunked_save as chunked_save
import shardkit.checkpoint.manager.checkpoint_manager as manager_module
from ranks import run_ranks
from shardkit.checkpoint import AsyncCheckpointer, CheckpointManager, ShardMetadata, load_consolidated
from shardkit.errors import MetadataError

import shardkit.checkpoint.background.checkpointer as async_save_module


class _Interrupted(BaseException):
    """What the test's SIGINT handler raises (as Ctrl-C raises KeyboardInterrupt)."""


def _state(value: float) -> dict:
    return {"w": torch.full((4096,), float(value)), "step": int(value)}


@pytest.fixture
def held_writes(monkeypatch):
    """Every background write waits until the returned event is set (a slow file system)."""
    release = threading.Event()

    def hold(module, name):
        write = getattr(module, name)

        def held(*args, **kwargs):
            assert release.wait(60), "the test never released the write"
            return write(*args, **kwargs)

        monkeypatch.setattr(module, name, held)

    hold(chunked_save, "_write_file")       # CheckpointManager
    hold(async_save_module, "_save_staged")  # AsyncCheckpointer
    yield release
    release.set()


def _interrupt_in(delay_s: float, call):
    """Run ``call()`` with a SIGINT arriving after ``delay_s``; return what it raised."""
    previous = signal.signal(signal.SIGINT, lambda *_: (_ for _ in ()).throw(_Interrupted()))
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(_Interrupted) as raised:
            call()
        return raised.value
    finally:
        timer.cancel()
        timer.join()  # no SIGINT can arrive once the test's handler is gone
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_waiting_never_lends_the_running_save_s_buffers_to_the_next(tmp_path, held_writes):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(100, _state(100))
    _interrupt_in(0.3, lambda: mgr.save(101, _state(101)))  # interrupted while it waits for step 100
    threading.Timer(0.5, held_writes.set).start()            # step 100 goes on writing after that
    mgr.save(150, _state(150))                               # waits for step 100 before staging
    mgr.close()
    assert mgr.steps() == [100, 150]
    for step in (100, 150):
        saved = load_consolidated(str(tmp_path / f"step-{step}"))
        assert saved["step"] == step and saved["w"].unique().tolist() == [float(step)], step


def test_an_interrupted_close_tears_nothing_down_and_a_second_close_finishes_the_save(tmp_path, held_writes):
    ckpt = AsyncCheckpointer(tmp_path / "c", 0, 1, ShardMetadata(num_ranks=1, tensor_specs={}))
    future = ckpt.save_async(_state(7))
    _interrupt_in(0.3, ckpt.close)
    assert not future.done()
    threading.Timer(0.3, held_writes.set).start()
    ckpt.close()  # still open: it waits for the save
    assert future.done()
    assert load_consolidated(str(tmp_path / "c"))["w"].unique().tolist() == [7.0]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_rotation_is_logged_and_the_committed_step_is_not_called_failed(tmp_path, monkeypatch, caplog,
                                                                                async_save):
    def refuse(storage, path):  # rotation's removal of an old step (clearing the step being saved is not)
        raise OSError(5, "Input/output error")

    mgr = CheckpointManager(tmp_path, keep_last=1, async_save=async_save)
    mgr.save(1, _state(1))
    mgr.wait()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="shardkit"):
        m.setattr(manager_module, "remove_step", refuse)
        mgr.save(2, _state(2))
        mgr.wait()  # raised "the checkpoint there is incomplete" (async), or only printed a thread's traceback
    assert "removing old checkpoints failed" in caplog.text and "Input/output error" in caplog.text
    assert mgr.steps() == [1, 2]
    mgr.save(3, _state(3))  # the next rotation removes what the failed one left
    mgr.close()
    assert mgr.steps() == [3]


def test_metrics_of_a_diverged_run_are_kept_and_bad_ones_refused_before_anything_is_written(tmp_path):
    with CheckpointManager(tmp_path, best="loss") as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.5})
        mgr.save(2, _state(2), metrics={"loss": float("nan"), "acc": torch.tensor(0.25), "n": np.int64(3),
                                        "gnorm": float("-inf")})
        mgr.wait()
        got = mgr.metrics(2)
        assert math.isnan(got["loss"]) and got["acc"] == 0.25 and got["n"] == 3 and got["gnorm"] == -math.inf
        for bad in ({"loss": "low"}, {"loss": torch.ones(2)}, {3: 1.0}):
            with pytest.raises(MetadataError):
                mgr.save(3, _state(3), metrics=bad)
        assert not (tmp_path / "step-3").exists()
        mgr.save(3, _state(3), metrics={"loss": 0.75})
    assert mgr.steps() == [1, 2, 3]  # keep_last=3; step 1 also is the best: a NaN loss never wins


CHILD = """
import sys
import shardkit.checkpoint.saving.chunked_save as cs
from shardkit.checkpoint import CheckpointManager
import torch

def full(*args, **kwargs):
    raise OSError(28, "No space left on device")

cs._write_file = full
mgr = CheckpointManager(sys.argv[1])
mgr.save(5, {"w": torch.ones(8)})
# the job ends here: no wait(), no close()
"""


def test_a_failed_save_nobody_waited_for_is_reported_at_exit(tmp_path):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert "failed, and nothing waited for it" in done.stderr and "No space left" in done.stderr, done.stderr


def test_close_frees_the_staging_buffers(tmp_path):
    import shardkit.checkpoint.api as api

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        assert api._STAGING  # kept between saves, for the next one
    assert not api._STAGING


def _dedicated_group_deadline(rank, world_size):
    import torch.distributed as dist

    from shardkit.comm.process_group_view import process_group_timeout

    ckpt = AsyncCheckpointer("/unused", rank, world_size, ShardMetadata(num_ranks=world_size, tensor_specs={}),
                             group=dist.group.WORLD)
    return process_group_timeout(ckpt._own_group).total_seconds(), process_group_timeout(dist.group.WORLD).total_seconds()


def test_the_background_group_keeps_the_training_group_s_deadline(tmp_path):
    # torch's new_group default is 30 minutes: a stalled rank held every wait() and exit that long
    for own_s, training_s in run_ranks(_dedicated_group_deadline, 2, tmp_path):
        assert own_s == training_s == 120


def _staging_fails_on_rank_1(rank, world_size, root):
    import torch.distributed as dist

    import shardkit.checkpoint.api as api
    from shardkit.errors import AsyncCheckpointError

    real_stage = {"api": api.stage_against, "async": async_save_module.stage}

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory (simulated)")

    def staging_fails(fails: bool):
        api.stage_against = out_of_memory if fails else real_stage["api"]
        async_save_module.stage = out_of_memory if fails else real_stage["async"]

    seen = {}
    mgr = CheckpointManager(f"{root}/mgr", group=dist.group.WORLD)
    ckpt = AsyncCheckpointer(f"{root}/ac", rank, world_size, ShardMetadata(num_ranks=world_size, tensor_specs={}),
                             group=dist.group.WORLD, overwrite=True)
    staging_fails(rank == 1)
    try:
        mgr.save(1, _state(1))
        mgr.wait(timeout=60)  # rank 0: the failure arrives at the save's first exchange, not at the timeout
    except AsyncCheckpointError as e:
        seen["manager"] = str(e)
    try:
        ckpt.save_async(_state(1)).wait(timeout=60)
    except AsyncCheckpointError as e:
        seen["checkpointer"] = str(e)
    staging_fails(False)
    mgr.save(2, _state(2))   # both go on saving
    ckpt.save_async(_state(2)).wait(timeout=60)
    mgr.close()
    ckpt.close()
    return seen, mgr.steps()


def test_a_staging_failure_on_one_rank_fails_every_rank_s_save_at_once(tmp_path):
    for rank, (seen, steps) in enumerate(run_ranks(_staging_fails_on_rank_1, 2, tmp_path, str(tmp_path))):
        assert set(seen) == {"manager", "checkpointer"}, (rank, seen)   # was AsyncWaitTimeout on rank 0
        assert all("not enough memory (simulated)" in message for message in seen.values()), (rank, seen)
        assert steps == [2]
    assert load_consolidated(str(tmp_path / "ac"))["step"] == 2

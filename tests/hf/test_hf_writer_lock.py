"""One writer per Hugging Face checkpoint directory: ``save_checkpoint`` holds the writer lock.

Real processes: an HF save held in the middle of a shard while a second HF
save (or a distributed save) starts; an HF writer SIGKILLed mid-save.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading

import pytest
import torch
from held_writes import hold_writes, held_writer_process

from shardkit.errors import CheckpointBusyError
from shardkit.hf import load_checkpoint, save_checkpoint, validate_checkpoint
from shardkit.storage import is_lock_name

HANG_GUARD_S = 60


def _state(value: float) -> dict:
    return {"a": torch.full((64,), value), "b": torch.full((8, 8), value)}


def _hf_save_held_mid_write(directory, value, started, release) -> None:
    import shardkit.hf.saving.export_write as hf_writer  # the one HF writer save_checkpoint goes through

    hold_writes(hf_writer, started, release, HANG_GUARD_S)
    save_checkpoint(directory, _state(value), safetensors=True, max_shard_size=256)


@pytest.fixture
def held_hf_writer(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardkit.hf"])
    with held_writer_process(ctx, _hf_save_held_mid_write, str(tmp_path / "hf"), 1.0, HANG_GUARD_S,
                             "HF writer") as held:
        yield held


def _fails_at_once(fn) -> BaseException | None:
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "the second writer blocked instead of failing at once"
    return out.get("error")


def test_concurrent_hf_saves_the_second_fails_at_once_naming_the_first(held_hf_writer):
    from shardkit.checkpoint import save_distributed

    p, directory, release = held_hf_writer
    error = _fails_at_once(lambda: save_checkpoint(directory, _state(2.0), safetensors=True))
    assert isinstance(error, CheckpointBusyError)
    assert f"pid {p.pid} on host {socket.gethostname()}" in str(error) and "hf.save_checkpoint" in str(error)
    error = _fails_at_once(lambda: save_distributed({"w": torch.ones(2)}, directory, 0, 1, None))
    assert isinstance(error, CheckpointBusyError)                  # the same directory, any format
    for _ in range(4):
        release.release()                                           # at least one per shard of the held save
    p.join(HANG_GUARD_S)
    assert p.exitcode == 0
    assert validate_checkpoint(directory)
    loaded = load_checkpoint(directory, device="cpu")
    assert torch.equal(loaded["a"], torch.full((64,), 1.0)) and torch.equal(loaded["b"], torch.full((8, 8), 1.0))
    assert not any(is_lock_name(n) for n in os.listdir(directory))


def test_a_sigkilled_hf_writer_leaves_no_stuck_lock(held_hf_writer):
    p, directory, _ = held_hf_writer
    os.kill(p.pid, signal.SIGKILL)
    p.join(HANG_GUARD_S)
    assert not validate_checkpoint(directory)
    save_checkpoint(directory, _state(3.0), safetensors=True)
    assert validate_checkpoint(directory)
    assert torch.equal(load_checkpoint(directory, device="cpu")["a"], torch.full((64,), 3.0))
    assert not any(is_lock_name(n) for n in os.listdir(directory))

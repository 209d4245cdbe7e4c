"""A rank that dies during a group save over a plain torch ProcessGroup: the others get a CommError.

Three Gloo ranks save a first checkpoint together, then start a second save
during which rank 2 calls ``os._exit``: while preparing (before anything is
withdrawn or written) or while writing its data file. The survivors must
raise a ``CommError`` (not Gloo's raw ``RuntimeError``) that names the save
step; the checkpoint saved before stays loadable bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_distributed, save_distributed, validate_distributed
from shardkit.errors import CommError
from shardkit.launch import run_local_ranks

pytestmark = pytest.mark.multiproc

WORLD = 3
NUMEL = 4096
SPEC = ShardMetadata(WORLD, {"w": TensorShardSpec((WORLD * NUMEL,), 0, (NUMEL,) * WORLD)})


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((NUMEL,), float(10 * step + rank)), "step": step}


def _expected_w(step: int) -> torch.Tensor:
    return torch.cat([torch.full((NUMEL,), float(10 * step + r)) for r in range(WORLD)])


def _save_then_die(rank: int, world_size: int, first_dir: str, second_dir: str, die_in: str):
    import importlib

    module, _, die_in = die_in.rpartition(".")
    save_module = importlib.import_module(f"shardkit.checkpoint.{module}")

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))  # a plain torch ProcessGroup
    save_distributed(_state(1, rank), first_dir, rank, world_size, SPEC, group=group)
    if rank == 2:
        setattr(save_module, die_in, lambda *a, **k: os._exit(7))
    try:
        save_distributed(_state(2, rank), second_dir, rank, world_size, SPEC, group=group)
    except CommError as e:
        return type(e).__name__, str(e)
    except Exception as e:  # noqa: BLE001 - the test reports what it got instead
        return f"not a CommError: {type(e).__name__}", str(e)
    return "no error", ""


@pytest.mark.parametrize("die_in, step, same_dir", [
    ("saving.distributed_save._prepare", "preparing and locking the save", True),   # before anything is withdrawn
    ("saving.chunked_save._write_file", "writing the data files", False),    # after the old commit was withdrawn
])
def test_survivors_of_a_dead_peer_raise_comm_error_and_the_previous_checkpoint_loads(tmp_path, die_in, step,
                                                                                       same_dir):
    first = str(tmp_path / "ck" / "step-1")
    second = first if same_dir else str(tmp_path / "ck" / "step-2")
    results = run_local_ranks(_save_then_die, WORLD, first, second, die_in, may_die={2}, timeout_s=180,
                              workdir=str(tmp_path))
    for rank in (0, 1):
        name, message = results[rank]
        assert name in ("CommError", "CommTimeoutError", "CommAbortedError"), (rank, name, message)
        assert step in message and "peer rank" in message, message
    loaded = load_distributed(first, 0, 1)
    assert torch.equal(loaded["w"], _expected_w(1)) and loaded["step"] == 1
    assert validate_distributed(first).ok
    if not same_dir:
        assert not validate_distributed(second).ok

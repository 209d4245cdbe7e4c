"""Incremental checkpoints on object stores: a real S3 server (SeaweedFS, see conftest.py) and ``memory://``.

The same references as on local disk, under one prefix: a chain saved by
``CheckpointManager(incremental=True)`` loads bit for bit, rotation keeps
the step a kept step references (and deletes its objects once none does),
and a base removed by hand is a typed error naming it.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit.checkpoint import CheckpointManager, validate_distributed
from shardkit.errors import MissingBaseError
from shardkit.storage import storage_for


def _state(step: int) -> dict:
    frozen = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    return {"frozen": frozen, "adapter": torch.full((4, 16), float(step)), "step": step}


def _empty() -> dict:
    return {"frozen": torch.empty(128, 16), "adapter": torch.empty(4, 16), "step": None}


def _run_chain(root: str, async_save: bool) -> None:
    with CheckpointManager(root, keep_last=1, incremental=True, async_save=async_save) as mgr:
        for step in range(4):
            mgr.save(step, _state(step))
            mgr.wait()
            assert mgr.steps() == ([0] if step == 0 else [0, step])   # 0 kept: every step references it
        for step in mgr.steps():
            assert validate_distributed(mgr.step_dir(step)).ok
        out = _empty()
        assert mgr.restore(out) == 3
        assert torch.equal(out["frozen"], _state(3)["frozen"]) and torch.equal(out["adapter"], _state(3)["adapter"])
        full = _state(4)
        full["frozen"] = full["frozen"] + 1
        mgr.save(4, full)
        mgr.wait()
        assert mgr.steps() == [4]                                        # nothing references 0 any more
        store, _ = storage_for(root)
        assert not store.exists(store.join(mgr.step_dir(0), "rank_0.safetensors"))


def _removed_base_is_typed(root: str) -> None:
    ck.save(_state(0), f"{root}/a")
    ck.save(_state(1), f"{root}/b", base=f"{root}/a")
    store, directory = storage_for(f"{root}/a")
    store.remove_tree(directory)
    with pytest.raises(MissingBaseError, match="'?a'?"):
        ck.load(_empty(), f"{root}/b")


@pytest.mark.parametrize("async_save", [True, False])
def test_memory_store_chain_and_rotation(async_save):
    _run_chain(f"memory://inc-{uuid.uuid4().hex}", async_save)


def test_memory_store_removed_base():
    _removed_base_is_typed(f"memory://inc-{uuid.uuid4().hex}")


def test_s3_chain_and_rotation(s3_url):
    _run_chain(s3_url, async_save=True)


def test_s3_removed_base(s3_url):
    _removed_base_is_typed(s3_url)

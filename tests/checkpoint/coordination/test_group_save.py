"""The group path of save_distributed on real Gloo ranks (one spawn each, kept small)."""

import os

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks
from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    load_distributed,
    read_metadata,
    save_distributed,
    validate_distributed,
)
from shardkit.errors import CheckpointError, TensorMismatchError

pytestmark = pytest.mark.multiproc

FULL_W = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
FULL_V = torch.arange(5 * 7, dtype=torch.bfloat16).reshape(5, 7)


class _Wrapped:
    """Stands in for shardkit's comm.Group: anything with a .process_group."""

    def __init__(self, pg):
        self.process_group = pg


def _spec(world):
    return ShardMetadata(world, {
        "w": TensorShardSpec((10, 6), 0, tuple(compute_shard_sizes(10, world))),
        "v": TensorShardSpec((5, 7), 1, tuple(compute_shard_sizes(7, world))),
    })


def _local(rank, world):
    w_sizes, v_sizes = compute_shard_sizes(10, world), compute_shard_sizes(7, world)
    return {"w": FULL_W.narrow(0, sum(w_sizes[:rank]), w_sizes[rank]),
            "v": FULL_V.narrow(1, sum(v_sizes[:rank]), v_sizes[rank]),
            "rep": torch.full((3,), 7.0), "step": 11}


def _save_good_then_bad(rank, world, root):
    save_distributed(_local(rank, world), os.path.join(root, "good"), rank, world, _spec(world),
                     group=_Wrapped(dist.group.WORLD))
    bad = _local(rank, world)
    if rank == 2:
        bad["w"] = torch.zeros(1, 1)  # only this rank is wrong: every rank must fail, none may hang
    try:
        save_distributed(bad, os.path.join(root, "bad"), rank, world, _spec(world), group=dist.group.WORLD)
    except (CheckpointError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def test_save_on_4_with_group_load_on_3(tmp_path):
    errors = run_ranks(_save_good_then_bad, 4, tmp_path, str(tmp_path))
    good = tmp_path / "good"
    assert validate_distributed(good).ok
    meta = read_metadata(good)
    assert sorted(meta.files) == [f"rank_{r}.safetensors" for r in range(4)]  # rank 0 gathered every record
    outs = [load_distributed(good, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([o["w"] for o in outs], 0), FULL_W)
    assert torch.equal(torch.cat([o["v"] for o in outs], 1), FULL_V)
    assert all(torch.equal(o["rep"], torch.full((3,), 7.0)) and o["step"] == 11 for o in outs)
    assert errors[2][0] == TensorMismatchError.__name__ and "rank 2 of 4" in errors[2][1]
    for rank in (0, 1, 3):
        assert errors[rank][0] == "CheckpointError" and "failed on rank 2" in errors[rank][1]
    assert not (tmp_path / "bad" / "metadata.json").exists()


def test_save_over_shardkit_local_group_then_load_on_3(tmp_path):
    """A shardkit comm.Group (threads, standalone Gloo) coordinates a save like a torch group."""
    import threading

    from shardkit.comm import Group

    spec = ShardMetadata(2, {"w": TensorShardSpec((6, 2), 0, (3, 3))})
    full = torch.arange(12.0).reshape(6, 2)
    groups = Group.local(2)
    errors = []

    def save(g):
        try:
            save_distributed({"w": full[3 * g.rank: 3 * g.rank + 3].clone(), "step": 1}, str(tmp_path / "ck"),
                             g.rank, 2, spec, group=g)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(g,)) for g in groups]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    for g in groups:
        g.close()
    assert not errors
    parts = [load_distributed(str(tmp_path / "ck"), r, 3)["w"] for r in range(3)]
    assert torch.equal(torch.cat(parts), full)

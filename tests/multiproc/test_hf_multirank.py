"""shardkit.hf on real Gloo ranks: each rank writes only its own shards of one shared index.

The index is planned on every rank from meta-device tensors (shapes only);
each rank writes its files, a barrier, then rank 0 commits the index. The
parent then checks the files and loads the whole checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks
from shardkit.hf import (
    index_file_name,
    load_checkpoint,
    make_shard_index,
    save_shard_index,
    save_sharded_checkpoint,
    validate_checkpoint,
)

pytestmark = pytest.mark.multiproc

WORLD = 2


def _stage(rank: int, device="cpu") -> dict:
    gen = torch.Generator().manual_seed(rank)
    shapes = {f"stage{rank}.layer{i}.w": (64, 32 + 8 * i) for i in range(3)}
    if device == "meta":
        return {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _rank(rank: int, world_size: int, out_dir: str):
    index = make_shard_index([_stage(r, "meta") for r in range(world_size)], safetensors=True,
                             max_shard_size=20_000)
    save_sharded_checkpoint(out_dir, index, _stage(rank), safetensors=True)
    dist.barrier()  # every rank's shards are complete before the index makes the checkpoint count
    if rank == 0:
        save_shard_index(index, out_dir, index_file_name(True))
    dist.barrier()
    mine = load_checkpoint(out_dir, None, keys=set(_stage(rank, "meta")))
    written = sorted({index["weight_map"][n] for n in _stage(rank, "meta")})
    return written, all(torch.equal(mine[n], t) for n, t in _stage(rank).items())


def test_each_rank_writes_its_own_shards_of_one_index(tmp_path):
    out_dir = str(tmp_path / "ckpt")
    results = run_ranks(_rank, WORLD, tmp_path, out_dir)
    files_by_rank = [set(files) for files, _ in results]
    assert all(ok for _, ok in results)
    assert not files_by_rank[0] & files_by_rank[1]
    assert set(os.listdir(out_dir)) == files_by_rank[0] | files_by_rank[1] | {index_file_name(True)}
    assert validate_checkpoint(out_dir)
    full = load_checkpoint(out_dir, None)
    for r in range(WORLD):
        for name, t in _stage(r).items():
            assert torch.equal(full[name], t)

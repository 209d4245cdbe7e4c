"""Rank functions for ``test_incremental_multirank.py`` (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(10, 6, generator=g), "emb": torch.randn(7, 3, generator=g).bfloat16(),
            "head": torch.full((6, 4), float(step)), "bias": torch.arange(5.0) + (step if step >= 2 else 0),
            "step": step}


def save_chain_job(rank: int, world_size: int, root: str, background: bool = False) -> dict:
    """Steps 0 (full), 1 and 2 (incremental) of a state with DTensor leaves sharded over the ranks, with
    ``save`` or (``background``) ``async_save(...).wait()``; returns the names each incremental save
    compared with its base file on this rank."""
    import shardkit.checkpoint as ck
    from shardkit.checkpoint.saving import incremental

    compared, real = [], incremental.ByteProof

    def spy(candidates, **kwargs):
        compared.append(sorted(c.name for c in candidates))
        return real(candidates, **kwargs)

    incremental.ByteProof = spy
    mesh = init_device_mesh("cpu", (world_size,))
    for step in range(3):
        full = full_state(step)
        state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                 "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),
                 "head": distribute_tensor(full["head"], mesh, [Shard(0)]),
                 "bias": full["bias"], "step": step}
        base = f"{root}/step-{step - 1}" if step else None
        if background:
            ck.async_save(state, f"{root}/step-{step}", base=base).wait()
        else:
            ck.save(state, f"{root}/step-{step}", base=base)
    return {"rank": rank, "compared": compared}

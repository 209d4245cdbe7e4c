"""Rank functions for test_save_in_job.py: FSDP2 and hand-made DTensor states saved as HF from every rank."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hf_helpers import tiny_llama
from shardkit.hf import save_checkpoint


def fsdp_llama(world_size: int, tied: bool):
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(tied=tied, seed=3)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()   # one step: the weights are no longer the seed's
    optim.step()
    optim.zero_grad()
    return model, optim


def save_fsdp_llama(rank, world_size, out_dir, tied, as_dict):
    """Save an FSDP2 Llama as bf16 HF from every rank; rank 0 writes its full fp32 weights beside it."""
    model, _ = fsdp_llama(world_size, tied)
    if as_dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, _ = get_state_dict(model, [])
        save_checkpoint(out_dir, model_sd, safetensors=True, dtype=torch.bfloat16)
    else:
        save_checkpoint(out_dir, model, safetensors=True, dtype=torch.bfloat16)
    full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()}
    if rank == 0:  # to a file: tensors returned through the result queue would be shared-memory handles
        from safetensors.torch import save_file

        save_file({n: t.detach().clone().contiguous() for n, t in full.items()}, out_dir + ".reference.safetensors")


def mixed_full() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "rows": torch.randn(5, 3, generator=g),           # Shard(0), uneven over 2 ranks
        "cols": torch.randn(4, 7, generator=g),           # Shard(1): each part is not contiguous in the whole
        "tiny": torch.randn(1, 4, generator=g),           # Shard(0) with an empty part on rank 1
        "same": torch.randn(6, generator=g),              # Replicate
        "ids": torch.arange(12).reshape(3, 4),            # an integer DTensor: not cast
        "plain": torch.randn(2, 2, generator=g),          # a plain tensor beside DTensors
        "scalar": torch.tensor(2.5),
    }


def mixed_state(world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    place = {"rows": Shard(0), "cols": Shard(1), "tiny": Shard(0), "same": Replicate(), "ids": Shard(0)}
    return {n: distribute_tensor(t, mesh, [place[n]]) if n in place else t for n, t in mixed_full().items()}


def save_mixed(rank, world_size, out_dir, max_shard_size, safetensors):
    save_checkpoint(out_dir, mixed_state(world_size), safetensors=safetensors, dtype=torch.float16,
                    max_shard_size=max_shard_size)
    return True


def save_failing_on_rank_1(rank, world_size, out_dir):
    """Rank 1's disk is full: every rank must raise (none left waiting) and no index may appear."""
    import shardkit.hf.saving.export_write as writer

    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        writer.write_safetensors = full_disk
    try:
        save_checkpoint(out_dir, mixed_state(world_size), safetensors=True, max_shard_size=60)
    except Exception as e:  # noqa: BLE001 - the test checks its type and message
        return type(e).__name__, str(e)
    return None


def save_mismatched(rank, world_size, out_dir):
    """Rank 1 holds one tensor more: every rank must refuse, and nothing may be written."""
    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}
    if rank == 1:
        sd["extra"] = torch.zeros(3)
    try:
        save_checkpoint(out_dir, sd, safetensors=True)
    except Exception as e:  # noqa: BLE001 - the test checks its type and message
        return type(e).__name__, str(e)
    return None

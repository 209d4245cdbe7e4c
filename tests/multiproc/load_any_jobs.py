"""Rank functions for ``test_load_any_format_multirank.py`` (importable by the forkserver ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardkit.checkpoint as ckpt
from byte_counting import counting_reads
from shardkit.checkpoint.loading.load_into import state_leaves
from dtensor_jobs import local_values, parallel, state, train_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def fsdp_llama(hf_dir: str, world_size: int, seed: int):
    """The checkpoint's model class, built from its config.json in fp32 with other values, FSDP2-sharded."""
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(hf_dir)).float()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _mismatched(model, hf_dir: str) -> list[str]:
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    ours = {n: t.full_tensor() for n, t in model.state_dict().items()}
    assert set(ours) == set(reference), (set(ours) ^ set(reference))
    return [n for n, t in ours.items() if t.dtype != torch.float32 or not torch.equal(t, reference[n])]


def hf_into_fsdp2_job(rank, world_size, hf_dir):
    """``ckpt.load(fsdp_model.state_dict(), bf16 HF dir, cast=True)``: the weights from_pretrained gives (fp32),
    and this rank's data bytes read: exactly its shards' bytes (a tied weight read once)."""
    model = fsdp_llama(hf_dir, world_size, seed=100 + rank)
    with counting_reads() as counted:
        ckpt.load(model.state_dict(), hf_dir, cast=True)
    path = os.path.join(hf_dir, "model.safetensors")
    with open(path, "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
    locals_ = [t.to_local() for t in model.state_dict().values()]
    unique = {(t.untyped_storage().data_ptr(), t.storage_offset()): t for t in locals_}.values()  # tied: once
    own_bytes = sum(t.numel() * 2 for t in unique)                      # bf16 on disk
    return _mismatched(model, hf_dir), counted.total("model.safetensors", header_end), own_bytes, \
        os.path.getsize(path) - header_end


def hf_load_checkpoint_fsdp2_job(rank, world_size, hf_dir):
    """``shardkit.hf.load_checkpoint(dir, fsdp_module)`` fills the shards (the issue's data_ptr error)."""
    from shardkit.hf import load_checkpoint

    model = fsdp_llama(hf_dir, world_size, seed=200 + rank)
    load_checkpoint(hf_dir, model)
    return _mismatched(model, hf_dir)


def dcp_save_job(rank, world_size, root):
    model, optim = parallel("fsdp", seed=1, world_size=world_size)
    train_step(model, optim, 0)
    dcp.save(state(model, optim, step=1), checkpoint_id=f"{root}/dcp")
    return True


def dcp_load_compare_job(rank, world_size, root):
    """Load the DCP checkpoint with ``ckpt.load`` and with ``dcp.load`` into the same FSDP2 state; compare."""
    model, optim = parallel("fsdp", seed=2, world_size=world_size)
    train_step(model, optim, 5)                     # creates the optimizer state (other values)
    sd = state(model, optim)
    before = local_values(sd)
    ckpt.load(sd, f"{root}/dcp")
    ours, our_step, our_groups = local_values(sd), sd["step"], repr(sd["optim"]["param_groups"])
    for t in state_leaves(sd)[0].values():          # scrub, so dcp.load has to write every value again
        (t.to_local() if hasattr(t, "to_local") else t).detach().fill_(-1)
    sd["step"] = 0
    dcp.load(sd, checkpoint_id=f"{root}/dcp")
    theirs = local_values(sd)
    changed = [n for n in ours if ours[n].numel() and not torch.equal(ours[n], before[n])]
    return ([n for n in ours if not torch.equal(ours[n], theirs[n])], len(changed), our_step, sd["step"],
            our_groups == repr(sd["optim"]["param_groups"]))

"""Checkpoints of CUDA state: saves, loads onto and into the GPU, the manager, HF files, FSDP2.

Skipped without CUDA (see tests/conftest.py). One GPU is enough.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardkit.checkpoint as ckpt
from shardkit.checkpoint import CheckpointManager, load_distributed
from shardkit.hf import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.gpu


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    optim.step()
    return model, optim


def _host(state):
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def test_save_then_load_in_place_keeps_tensors_on_the_gpu(tmp_path):
    model, optim = _trained()
    saved = {"model": _host(model.state_dict()), "optim": optim.state_dict()}
    ckpt.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 3}, tmp_path / "s")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 0}
    ckpt.load(state, tmp_path / "s")
    assert state["step"] == 3
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), saved["model"][k])
    exp_avg = state["optim"]["state"][0]["exp_avg"]
    assert exp_avg.is_cuda and torch.equal(exp_avg.cpu(), saved["optim"]["state"][0]["exp_avg"].cpu())


@pytest.mark.parametrize("verify", [None, True])
def test_load_distributed_onto_the_gpu_mapped_and_verified(tmp_path, verify):
    model, _ = _trained()
    ckpt.save({"model": model.state_dict()}, tmp_path / "s")
    out = load_distributed(tmp_path / "s", 0, 1, device="cuda", verify=verify)
    for k, v in model.state_dict().items():
        got = out["model"][k]
        assert got.device.type == "cuda" and torch.equal(got, v)


def test_load_distributed_into_gpu_tensors_fills_them(tmp_path):
    model, _ = _trained()
    ckpt.save({"model": model.state_dict()}, tmp_path / "s")
    other, _ = _trained(seed=1)
    target = {"model": other.state_dict()}
    ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
    load_distributed(tmp_path / "s", 0, 1, out=target)
    for k, v in model.state_dict().items():
        assert target["model"][k].data_ptr() == ptrs[k] and torch.equal(target["model"][k], v)


def test_manager_saves_a_snapshot_of_gpu_state_in_the_background(tmp_path):
    model, optim = _trained()
    before = _host(model.state_dict())
    with CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": optim.state_dict()})
        with torch.no_grad():  # changes after save() returns must not reach step 1
            for p in model.parameters():
                p.add_(1)
        mgr.wait()
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        assert mgr.restore(state) == 1
    for k, v in model.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), before[k])


@pytest.mark.parametrize("assign", [False, True])
def test_hf_save_from_and_load_into_a_gpu_module(tmp_path, assign):
    model, _ = _trained()
    save_checkpoint(str(tmp_path / "hf"), model, safetensors=True)
    other, _ = _trained(seed=1)
    load_checkpoint(str(tmp_path / "hf"), other, device="cuda", assign=assign)
    for (k, v), w in zip(model.state_dict().items(), other.state_dict().values()):
        assert w.is_cuda and torch.equal(w, v), k
    flat = load_checkpoint(str(tmp_path / "hf"), device="cuda")
    assert all(t.is_cuda for t in flat.values())
    assert torch.equal(flat["0.weight"], model[0].weight)


def test_fsdp2_on_a_one_gpu_nccl_mesh_saves_and_reloads(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, _ = _trained()
        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 16, device="cuda")).sum().backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        expect = {k: v.full_tensor().cpu() for k, v in model_sd.items()}
        ckpt.save({"model": model_sd, "optim": optim_sd}, tmp_path / "s")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        ckpt.load(state, tmp_path / "s")
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got, _ = get_state_dict(model, optim)
        for k, v in got.items():
            assert v.device.type == "cuda" and torch.equal(v.full_tensor().cpu(), expect[k]), k
    finally:
        dist.destroy_process_group()

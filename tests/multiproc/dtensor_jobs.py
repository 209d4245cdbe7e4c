"""Rank functions for the DTensor / FSDP2 checkpoint tests (importable by the forkserver ranks)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardkit.checkpoint as ckpt


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 14 and 3 rows: uneven shards on 3 and 4 ranks, and a rank with an empty shard of the bias.
    return torch.nn.Sequential(torch.nn.Linear(10, 14), torch.nn.ReLU(), torch.nn.Linear(14, 3))


def parallel(kind: str, seed: int, world_size: int):
    model = make_model(seed)
    if kind == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    elif kind == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard")))
    elif kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optim


def train_step(model, optim, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())


def state(model, optim, step=0):
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def local_values(sd) -> dict:
    """Every tensor leaf's local tensor (a copy), by dotted name."""
    from shardkit.checkpoint.loading.load_into import state_leaves

    tensors, _ = state_leaves(sd)
    return {n: (t.to_local() if isinstance(t, DTensor) else t).detach().clone() for n, t in tensors.items()}


def save_job(rank, world_size, root, kinds):
    for kind in kinds:
        model, optim = parallel(kind, seed=1, world_size=world_size)
        train_step(model, optim, 0)
        sd = state(model, optim, step=1)
        ckpt.save(sd, f"{root}/{kind}/shardkit")
        dcp.save(sd, checkpoint_id=f"{root}/{kind}/dcp")
    return True


def load_compare_job(rank, world_size, root, kinds):
    """Load each saved kind into FSDP2 on this world size with shardkit and with DCP; compare bit for bit."""
    out = {}
    for kind in kinds:
        model, optim = parallel("fsdp", seed=2, world_size=world_size)
        train_step(model, optim, 5)          # creates the optimizer state (different values)
        sd = state(model, optim)
        ckpt.load(sd, f"{root}/{kind}/shardkit")
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ours = local_values(state(model, optim))
        step = sd["step"]

        model2, optim2 = parallel("fsdp", seed=3, world_size=world_size)
        train_step(model2, optim2, 6)
        sd2 = state(model2, optim2)
        dcp.load(sd2, checkpoint_id=f"{root}/{kind}/dcp")
        set_state_dict(model2, optim2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
        theirs = local_values(state(model2, optim2))
        assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
        bad = [n for n in ours if not (ours[n].dtype == theirs[n].dtype and torch.equal(ours[n], theirs[n]))]
        out[kind] = {"step": step, "mismatched": bad, "names": len(ours),
                     "moments": sum(1 for n in ours if "exp_avg" in n)}
        # and training goes on identically from both
        out[kind]["losses"] = [train_step(model, optim, 9), train_step(model2, optim2, 9)]
    return out


def ddp_save_job(rank, world_size, root):
    torch.manual_seed(7)
    model = torch.nn.Linear(6, 5)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 6)).sum().backward()
    optim.step()
    sd = state(model, optim, step=3)
    ckpt.save(sd, f"{root}/ddp", rank_state={"rng": torch.full((4,), rank, dtype=torch.int64), "pos": 10 * rank})
    return {n: _bytes(t) for n, t in local_values(sd).items()}


def _bytes(t: torch.Tensor) -> tuple:
    # plain data: tensors returned from a rank would travel through shared memory
    return str(t.dtype), tuple(t.shape), t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def ddp_load_job(rank, world_size, root):
    torch.manual_seed(8)
    model = torch.nn.Linear(6, 5)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sd = state(model, optim)
    import warnings

    rank_state = {"rng": torch.full((4,), -1, dtype=torch.int64), "pos": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.load(sd, f"{root}/ddp", rank_state=rank_state)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = (rank_state["rng"].tolist(), rank_state["pos"], [str(w.message) for w in caught if "rank_state" in str(w.message)])
    return sd["step"], {n: _bytes(t) for n, t in local_values(state(model, optim)).items()}, got


def train_loop_job(rank, world_size, root, first_step, last_step, save_every):
    """FSDP2 training with a CheckpointManager: resume from the latest complete step, train, save.

    Every rank sees the same batch, so the loss does not depend on the world size.
    Returns (the step resumed from, the losses of the steps run)."""
    model, optim = parallel("fsdp", seed=1, world_size=world_size)
    sd = state(model, optim)
    train_step(model, optim, -1)      # creates Adam's state, overwritten by restore
    sd = state(model, optim)
    losses = {}
    with ckpt.CheckpointManager(root, keep_last=2) as mgr:
        resumed = mgr.restore(sd)
        if resumed is not None:
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            model, optim = parallel("fsdp", seed=1, world_size=world_size)   # a fresh run
        start = first_step if resumed is None else sd["step"]
        for step in range(start, last_step):
            losses[step] = train_step(model, optim, step)
            if (step + 1) % save_every == 0:
                mgr.save(step, {**state(model, optim), "step": step + 1})
    return resumed, losses


def compact_save_job(rank, world_size, root, kinds):
    """``save_job`` with every save's metadata in compact grid entries (``knobs.COMPACT_MIN_RANKS`` = 1)."""
    from shardkit import knobs
    knobs.COMPACT_MIN_RANKS = 1
    return save_job(rank, world_size, root, kinds)

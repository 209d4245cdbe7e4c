"""FSDP2 training that checkpoints in the background and resumes on any number of processes.

    torchrun --nproc-per-node 2 examples/train.py ckpt-run       # steps 0-5; checkpoints step-2, -4, -6
    torchrun --nproc-per-node 1 examples/train.py ckpt-run 10    # resumes from step-6 on one process

``Group.from_env()`` joins the job torchrun started (and makes it the default
process group, which FSDP2 and the manager use). Every rank trains on the same
batch, so the losses do not depend on the number of processes: the resumed
run prints the losses an uninterrupted one would. The model and Adam's state
are saved sharded (DTensor leaves from ``get_state_dict``) and resharded on load.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardkit.checkpoint import CheckpointManager
from shardkit.comm import Group

root = sys.argv[1] if len(sys.argv) > 1 else "ckpt-run"
last_step = int(sys.argv[2]) if len(sys.argv) > 2 else 6
group = Group.from_env()                     # Gloo on CPU, NCCL on GPUs
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
fully_shard(model, mesh=init_device_mesh("cpu", (group.world_size,)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
batch = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def train_step() -> float:
    loss = (model(batch) - batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def training_state() -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


with CheckpointManager(root, keep_last=2) as manager:
    start = 0
    if manager.latest_step() is not None:
        train_step()                         # Adam's moments exist after a first step; restore overwrites them
        state = training_state()
        start = manager.restore(state)       # the latest complete step, saved on any number of ranks
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(start, last_step):
        loss = train_step()
        if group.rank == 0:
            print(f"step {step} loss {loss:.6f} ({group.world_size} process(es))", flush=True)
        if (step + 1) % 2 == 0:
            manager.save(step + 1, training_state())     # returns once staged; writes in the background
group.close()

"""A rank of a job that saves in the background and never calls close(), wait() or destroy_process_group."""

import sys

import torch
import torch.distributed as dist

import shardkit.checkpoint as ck
from shardkit.checkpoint import AsyncCheckpointer

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
root = sys.argv[1]
state = {"w": torch.arange(4096, dtype=torch.float32) + rank, "step": 0}
ckptr = AsyncCheckpointer(root, rank, world_size, None, group=dist.group.WORLD)
ckptr.save_async(state, dir=f"{root}/old")
ckptr.wait()
ck.async_save(state, f"{root}/api").wait()
mgr = ck.CheckpointManager(f"{root}/mgr", keep_last=2)
for step in range(3):
    state["step"] = step
    mgr.save(step, state)
ck.async_save(state, f"{root}/last")      # in flight when the main thread ends

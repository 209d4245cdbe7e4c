"""Saves steps 1 and 2 with a CheckpointManager, then is SIGKILLed in the middle of step 3's save."""

import os
import signal
import sys

import torch

import shardkit.checkpoint.saving.chunked_save as chunked_save
from shardkit.checkpoint import CheckpointManager

root, async_mode = sys.argv[1], sys.argv[2] == "async"
state = {"w": torch.arange(1000, dtype=torch.float32), "step": 0}
mgr = CheckpointManager(root, keep_last=5, async_save=async_mode)
for step in (1, 2):
    state["step"] = step
    state["w"] += 1
    mgr.save(step, state)
mgr.wait()
real = chunked_save.write_safetensors


def write_then_die(*args, **kwargs):
    record = real(*args, **kwargs)            # the data file is written, metadata.json is not
    os.kill(os.getpid(), signal.SIGKILL)
    return record


chunked_save.write_safetensors = write_then_die
state["step"] = 3
mgr.save(3, state)
mgr.wait()

"""The process ``test_incremental_crash.py`` kills: an incremental save that SIGKILLs itself at a chosen point.

Run in a child process only. The kill points are ``crash_child``'s (bytes of a file written, before or
after a file is published). If the save finishes without reaching the kill point the child exits with
code 3, so a test notices a hook that never fired.
"""

from __future__ import annotations

import os

import torch

import crash_child


def make_state(step: int) -> dict:
    """A frozen 64 KiB tensor (the same every step), an 8 KiB adapter that changes every step."""
    frozen = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    return {"frozen": frozen, "adapter": torch.full((8, 256), float(step)), "step": step}


def save_and_die(directory: str, base: str, step: int, kill: dict) -> None:
    torch.set_num_threads(1)
    import shardkit.checkpoint as ck

    crash_child.install_kill_hooks(kill)
    ck.save(make_state(step), directory, base=base)
    os._exit(3)


def manager_save_and_die(root: str, step: int, kill: dict) -> None:
    torch.set_num_threads(1)
    from shardkit.checkpoint import CheckpointManager

    crash_child.install_kill_hooks(kill)
    with CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        mgr.save(step, make_state(step))
        mgr.wait()
    os._exit(3)

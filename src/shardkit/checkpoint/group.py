"""The process group a save runs over, and a pickle-free exchange of small JSON facts.

``group`` may be None (no coordination: the seed's behaviour), a torch
``ProcessGroup``, or any object with a ``.process_group`` attribute
(shardkit's ``comm.Group``; one whose ``process_group`` is None is a group of
one and needs no coordination). :func:`exchange` all-gathers one JSON value
per rank as ``uint8`` tensors: nothing is pickled, and every rank learns
every other rank's status, so a failure on one rank fails the save on all
ranks instead of leaving them blocked.

Example::

    coordinator = resolve_group(group, rank, world_size)
    statuses = exchange(coordinator, {"ok": True}, "writing the data files")   # one dict per rank
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from shardkit.comm import Group
from shardkit.comm.process_group_view import ProcessGroupView
from shardkit.errors import CommError, MetadataError

__all__ = ["resolve_group", "exchange", "EXCHANGE_OBSERVERS"]

#: Called after every exchange as ``f(rank, collectives, received_bytes)``: the all-gathers this rank
#: issued and the bytes it received from the other ranks. Empty unless a test or
#: ``bench/scale_bench.py`` counts a save's traffic (append, then remove, a callable).
EXCHANGE_OBSERVERS: list = []


def resolve_group(group: Any, rank: int, world_size: int):
    """What coordinates a save: None (no group, or a group of one), a shardkit
    ``comm.Group`` as it is (its timeouts and abort apply), or a torch
    ``ProcessGroup`` (or another object's ``.process_group``) wrapped in
    ``comm.ProcessGroupView``; checked against ``rank`` and ``world_size``.
    """
    if group is None:
        return None
    pg = getattr(group, "process_group", group)
    if pg is None:
        return None                      # a group of one: nothing to coordinate
    if isinstance(group, Group):
        coordinator = group
    elif isinstance(pg, dist.ProcessGroup):
        coordinator = ProcessGroupView(pg)
    else:
        raise TypeError(f"group must be None, a torch ProcessGroup, a shardkit comm.Group or an object "
                        f"with a .process_group, got {type(group).__name__}")
    if (coordinator.rank, coordinator.world_size) != (rank, world_size):
        raise MetadataError(
            f"save called with rank {rank} of world_size {world_size}, but this process is rank "
            f"{coordinator.rank} of {coordinator.world_size} in the group; pass the group's own rank and size"
        )
    return coordinator


def exchange(group, value: Any, step: str = "a step of the save") -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. A collective: all ranks call it.

    A failed collective (a peer died or hangs) raises the same ``CommError``
    subclass, its message naming ``step`` and saying what it means for the checkpoint.
    """
    try:
        return _exchange(group, value)
    except CommError as e:
        raise type(e)(
            f"the save could not go on while {step}: rank {group.rank} of {group.world_size} did not hear "
            f"from every other rank ({e}). A peer rank has probably died or stopped; this checkpoint is "
            f"incomplete (metadata.json was not written) and checkpoints in other directories are "
            f"untouched. Restart the job and resume from the latest complete checkpoint") from e


def _exchange(group, value: Any) -> list[Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    payload = json.dumps(value, separators=(",", ":")).encode("utf-8")
    lengths = group.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device))
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = group.all_gather(mine.to(device))
    for observe in list(EXCHANGE_OBSERVERS):
        observe(group.rank, 2, (group.world_size - 1) * (8 + longest))
    return [json.loads(bytes(t[: int(n.item())].cpu().numpy()).decode("utf-8"))
            for t, n in zip(gathered, lengths)]

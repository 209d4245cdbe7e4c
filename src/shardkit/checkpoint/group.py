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
    statuses = exchange(coordinator, {"ok": True})      # one dict per rank, by rank
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardkit.errors import MetadataError

__all__ = ["resolve_group", "exchange"]


class _TorchGroup:
    """A torch ``ProcessGroup`` seen through the one collective a save needs."""

    def __init__(self, pg):
        import torch.distributed as dist

        self.pg = pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.backend = dist.get_backend(pg)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.pg)
        return out


def resolve_group(group: Any, rank: int, world_size: int):
    """What coordinates a save: None (no group, or a group of one) or an object with
    ``rank``, ``world_size``, ``backend`` and ``all_gather(tensor) -> list``, checked
    against ``rank`` and ``world_size``.

    A shardkit ``comm.Group`` is used as it is (its timeouts and abort apply); a
    torch ``ProcessGroup``, or another object's ``.process_group``, is wrapped.
    """
    if group is None:
        return None
    import torch.distributed as dist

    pg = getattr(group, "process_group", group)
    if pg is None:
        return None                      # a group of one: nothing to coordinate
    if all(hasattr(group, a) for a in ("all_gather", "rank", "world_size", "backend")):
        coordinator = group
    elif isinstance(pg, dist.ProcessGroup):
        coordinator = _TorchGroup(pg)
    else:
        raise TypeError(f"group must be None, a torch ProcessGroup, a shardkit comm.Group or an object "
                        f"with a .process_group, got {type(group).__name__}")
    if (coordinator.rank, coordinator.world_size) != (rank, world_size):
        raise MetadataError(
            f"save called with rank {rank} of world_size {world_size}, but this process is rank "
            f"{coordinator.rank} of {coordinator.world_size} in the group; pass the group's own rank and size"
        )
    return coordinator


def exchange(group, value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. A collective: all ranks call it."""
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    payload = json.dumps(value, separators=(",", ":")).encode("utf-8")
    lengths = group.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device))
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = group.all_gather(mine.to(device))
    return [json.loads(bytes(t[: int(n.item())].cpu().numpy()).decode("utf-8"))
            for t, n in zip(gathered, lengths)]

"""The process group a save runs over, and a pickle-free exchange of small JSON facts.

``group`` may be None (no coordination: the seed's behaviour), a torch
``ProcessGroup``, or any object with a ``.process_group`` attribute
(shardkit's ``comm.Group``; one whose ``process_group`` is None is a group of
one and needs no coordination). :func:`exchange` all-gathers one JSON value
per rank as ``uint8`` tensors: nothing is pickled, and every rank learns
every other rank's status, so a failure on one rank fails the save on all
ranks instead of leaving them blocked.

Example::

    pg = resolve_group(group, rank, world_size)
    statuses = exchange(pg, {"ok": True})      # one dict per rank, by rank
"""

from __future__ import annotations

import json
from typing import Any

import torch

from shardkit.errors import MetadataError

__all__ = ["resolve_group", "exchange"]


def resolve_group(group: Any, rank: int, world_size: int):
    """The torch ProcessGroup behind ``group`` (None for none), checked against rank and world size."""
    if group is None:
        return None
    pg = group.process_group if hasattr(group, "process_group") else group
    if pg is None:
        return None
    import torch.distributed as dist

    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"group must be None, a torch ProcessGroup or an object with .process_group, "
                        f"got {type(group).__name__}")
    found_rank, found_world = dist.get_rank(pg), dist.get_world_size(pg)
    if (found_rank, found_world) != (rank, world_size):
        raise MetadataError(
            f"save called with rank {rank} of world_size {world_size}, but this process is rank "
            f"{found_rank} of {found_world} in the group; pass the group's own rank and size"
        )
    return pg


def _device(pg) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(pg, value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. A collective: all ranks call it."""
    import torch.distributed as dist

    device = _device(pg)
    world = dist.get_world_size(pg)
    payload = json.dumps(value, separators=(",", ":")).encode("utf-8")
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=pg)
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=pg)
    return [json.loads(bytes(t[: int(n.item())].cpu().numpy()).decode("utf-8"))
            for t, n in zip(gathered, lengths)]

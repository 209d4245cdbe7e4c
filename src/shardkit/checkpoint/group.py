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
from datetime import timedelta
from typing import Any

import torch

from shardkit.comm.abort import AbortHandle, wait_work
from shardkit.errors import CommError, MetadataError

__all__ = ["resolve_group", "exchange", "EXCHANGE_OBSERVERS"]

#: Called after every exchange as ``f(rank, collectives, received_bytes)``: the all-gathers this rank
#: issued and the bytes it received from the other ranks. Empty unless a test or
#: ``bench/scale_bench.py`` counts a save's traffic (append, then remove, a callable).
EXCHANGE_OBSERVERS: list = []


class _TorchGroup:
    """A torch ``ProcessGroup`` seen through the one collective a save needs.

    The collective is issued asynchronously and waited for by
    ``comm.abort.wait_work`` (the wait shardkit's own groups use), so a dead
    peer raises a ``CommError`` rather than the backend's ``RuntimeError``.
    """

    def __init__(self, pg):
        import torch.distributed as dist

        self.pg = pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.backend = dist.get_backend(pg)
        self.timeout = _timeout_of(pg)
        self._abort = AbortHandle()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        what = f"all_gather on rank {self.rank} of {self.world_size} (torch {self.backend} process group)"
        try:
            work = dist.all_gather(out, tensor, group=self.pg, async_op=True)
        except Exception as e:  # noqa: BLE001 - a backend that fails at once (peer already gone)
            raise CommError(f"{what} failed in the backend; a peer rank may have died. "
                            f"Backend said: {str(e).strip()[:300]}") from e
        wait_work(work, what=what, timeout=self.timeout, handle=self._abort, backend_wait=self.backend == "gloo")
        return out


def _timeout_of(pg) -> timedelta:
    """The process group's own timeout where torch tells it, else torch's default."""
    import torch.distributed as dist

    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; the backend's own timeout still applies
        return getattr(dist, "default_pg_timeout", timedelta(minutes=30))


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

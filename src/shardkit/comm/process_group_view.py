"""A torch ``ProcessGroup`` that shardkit did not create, seen through one fail-fast collective.

Checkpoint saves coordinate with a few small collectives (a gather to one
rank, a broadcast from it, rarely an all-gather). When the caller passes a
plain torch ``ProcessGroup`` (``dist.group.WORLD``, a ``new_group``) instead
of a :class:`~shardkit.comm.Group`, :class:`ProcessGroupView` issues them
asynchronously and waits for them with ``comm.abort.wait_work`` (the wait
``Group`` uses), so a dead peer raises a ``CommError`` within the group's
timeout rather than the backend's raw ``RuntimeError``, or a hang. It offers
``all_gather``, ``gather`` and ``broadcast`` only, with ``Group``'s
signatures: for anything else, build a ``Group``.

Example::

    view = ProcessGroupView(dist.group.WORLD)
    parts = view.all_gather(torch.tensor([view.rank]))
    at_root = view.gather(torch.tensor([view.rank]), 0)      # rank 0: every rank's; others: None
    same = view.broadcast(torch.tensor([view.rank]), 0)      # rank 0's, on every rank
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit.comm.abort import AbortHandle, wait_work
from shardkit.errors import CommError

__all__ = ["ProcessGroupView", "process_group_timeout"]


class ProcessGroupView:
    """``rank``, ``world_size``, ``backend``, ``timeout`` and fail-fast ``all_gather``, ``gather``
    and ``broadcast`` over ``pg`` (ranks are ``pg``'s own, as in ``Group``)."""

    def __init__(self, pg: "dist.ProcessGroup"):
        self.pg = pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.backend = dist.get_backend(pg)
        self.timeout = process_group_timeout(pg)
        self._abort = AbortHandle()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, ordered by rank (same shape and dtype on every rank)."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(lambda: dist.all_gather(out, tensor, group=self.pg, async_op=True), "all_gather")
        return out

    def gather(self, tensor: torch.Tensor, root: int) -> list[torch.Tensor] | None:
        """Rank ``root`` gets every rank's ``tensor`` in rank order; the other ranks get None."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == root else None
        dst = dist.get_global_rank(self.pg, root)     # torch < 2.6 has no group_dst
        self._wait(lambda: dist.gather(tensor, out, dst=dst, group=self.pg, async_op=True),
                   f"gather to rank {root}")
        return out

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """A new tensor holding rank ``root``'s ``tensor``; the input is left untouched."""
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        src = dist.get_global_rank(self.pg, root)
        self._wait(lambda: dist.broadcast(out, src=src, group=self.pg, async_op=True),
                   f"broadcast from rank {root}")
        return out

    def _wait(self, start, op: str) -> None:
        what = f"{op} on rank {self.rank} of {self.world_size} (torch {self.backend} process group)"
        try:
            work = start()
        except Exception as e:  # noqa: BLE001 - a backend that fails at once (peer already gone)
            raise CommError(f"{what} failed in the backend; a peer rank may have died. "
                            f"Backend said: {str(e).strip()[:300]}") from e
        wait_work(work, what=what, timeout=self.timeout, handle=self._abort, backend_wait=self.backend == "gloo")

def process_group_timeout(pg) -> timedelta:
    """The process group's own timeout where torch tells it, else torch's default."""
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; the backend's own timeout still applies
        return getattr(dist, "default_pg_timeout", timedelta(minutes=30))

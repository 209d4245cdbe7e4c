"""A group of its own for a background save's collectives (``AsyncCheckpointer``, ``async_save``).

Two threads issuing collectives on one process group can pair up different
operations across ranks and hang or corrupt both, so a save that runs on a
background thread while training goes on uses a new group over the same
ranks. This module only makes that group; it issues no collective itself.

Example::

    own = dedicated_gloo_group(dist.group.WORLD)   # every member rank calls it at the same point
"""

from __future__ import annotations

import torch.distributed as dist

from shardkit.checkpoint.background.shutdown import destroy_at_exit
from shardkit.comm import Group
from shardkit.comm.process_group_view import process_group_timeout
from shardkit.errors import AsyncCheckpointError

__all__ = ["dedicated_gloo_group"]


def dedicated_gloo_group(group):
    """A new group over ``group``'s ranks, for the background thread's collectives.

    A shardkit ``comm.Group`` is split into a copy of itself (its CPU
    tensors go over Gloo whatever its backend); a torch ProcessGroup gets a
    new Gloo group from ``torch.distributed.new_group``, with the training
    group's timeout. Raises :class:`AsyncCheckpointError` for a group torch
    does not know.
    """
    if isinstance(group, Group):
        return group.split(list(range(group.world_size)))
    pg = group
    try:
        ranks = dist.get_process_group_ranks(pg)
    except Exception as e:  # noqa: BLE001 - not a group torch.distributed registered
        raise AsyncCheckpointError(
            f"cannot create a dedicated Gloo group for background saves from {group!r}: "
            f"torch.distributed does not know it ({type(e).__name__}: {e}). Pass "
            f"dedicated_group=False with a group that nothing else uses while a save is in flight"
        ) from e
    # The training group's timeout, not torch's 30-minute default: a rank that stalls or never
    # joins a background save fails it (and the wait() on it) within the job's own deadline.
    own = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True,
                         timeout=process_group_timeout(pg))
    destroy_at_exit(own)  # before interpreter teardown, which aborted jobs that never destroyed it
    return own

"""Run a function on N real ranks, each its own process, WITHOUT a default process group.

``spawn_ranks(fn, 4, extra)`` creates one :class:`shardkit.comm.UniqueId` and
calls ``fn(rank, world_size, uid_bytes, *args)`` in four processes
(``shardkit.launch.run_local_ranks``); ``fn`` builds its own ``Group``
(usually ``Group.init_rank``). Returns the results ordered by rank. Ranks in
``may_die`` may exit without a result (their slot is ``None``): used to kill
a rank on purpose. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

from shardkit.comm import UniqueId
from shardkit.launch import run_local_ranks


def spawn_ranks(fn, world_size, *args, timeout_s=120, may_die=()):
    """Run ``fn(rank, world_size, uid_bytes, *args)`` on ``world_size`` processes; return results."""
    uid = UniqueId.new(host="127.0.0.1").as_bytes()
    try:
        return run_local_ranks(fn, world_size, uid, *args, timeout_s=timeout_s,
                               init_default_group=False, may_die=may_die)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None

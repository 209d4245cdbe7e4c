"""Groups and collectives on top of ``torch.distributed`` (Gloo on CPU, NCCL on GPU).

What is here: :class:`Group` (``init_rank`` with a :class:`UniqueId`,
``from_env`` for torchrun, ``local`` for threads of one process, ``split``),
its collectives with every :class:`ReduceOp`, the GPU-tensor rule
(``SHARDKIT_ENABLE_GPU_FALLBACK``), :class:`DeviceGroup` for several CUDA
devices in one process, and :class:`AbortHandle` so a dead rank never hangs
anyone. What is not: a transport of its own, or ``group=None`` conveniences.

Example::

    uid = UniqueId.new()                                  # rank 0; ship uid.as_bytes()
    with Group.init_rank(rank, world_size, uid) as g:
        g.all_reduce_(grads, ReduceOp.AVG)
"""

from shardkit.comm.abort import AbortHandle
from shardkit.comm.device_group import DeviceGroup
from shardkit.comm.gpu_policy import FALLBACK_ENV, GpuFallbackWarning
from shardkit.comm.group import Group
from shardkit.comm.process_group_view import ProcessGroupView
from shardkit.comm.reduce_op import ReduceOp
from shardkit.comm.unique_id import UniqueId

__all__ = [
    "ProcessGroupView",
    "AbortHandle",
    "DeviceGroup",
    "FALLBACK_ENV",
    "GpuFallbackWarning",
    "Group",
    "ReduceOp",
    "UniqueId",
]

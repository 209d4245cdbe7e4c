"""One process driving several CUDA devices with NCCL (``torch.cuda.nccl``).

A :class:`DeviceGroup` reduces or broadcasts a list of tensors, one per
device, in a single call from one thread; ``split()`` turns it into one
:class:`~shardkit.comm.Group` per device for one worker thread each. It does
not span processes (use ``Group.init_rank`` for that) and it does not work
without CUDA: construction validates the devices first and says why.

Example::

    dg = DeviceGroup(["cuda:0", "cuda:1"])
    dg.all_reduce_([g0, g1])                 # g0 on cuda:0, g1 on cuda:1, summed in place
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit.comm.reduce_op import ReduceOp, coerce_op, plan_reduction
from shardkit.errors import CommArgumentError, InvalidRankError, UnsupportedOpError

__all__ = ["DeviceGroup", "validate_devices"]

# NCCL's own op numbering, which torch.cuda.nccl passes through unchanged.
_NCCL_OP = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
_BY_TORCH_OP = {dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.PRODUCT: ReduceOp.PROD,
                dist.ReduceOp.MAX: ReduceOp.MAX, dist.ReduceOp.MIN: ReduceOp.MIN}


def validate_devices(devices) -> list[torch.device]:
    """Check that ``devices`` are >= 2 distinct CUDA devices; needs no GPU to run."""
    try:
        # A bare int means a CUDA index; torch.device(int) would need a GPU to resolve it.
        devs = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as e:
        raise CommArgumentError(f"DeviceGroup: cannot read devices {devices!r}: {e}") from e
    not_cuda = sorted({str(d) for d in devs if d.type != "cuda"})
    if not_cuda:
        raise UnsupportedOpError(
            f"DeviceGroup needs CUDA devices, got {not_cuda}; for CPU ranks in one process "
            "use Group.local(n) (Gloo), for CPU ranks across processes Group.init_rank"
        )
    devs = [torch.device("cuda", 0 if d.index is None else d.index) for d in devs]
    if len(set(devs)) != len(devs) or len(devs) < 2:
        raise InvalidRankError(
            f"DeviceGroup needs at least 2 distinct CUDA devices, got {[str(d) for d in devs]}; "
            "list each device once (e.g. ['cuda:0', 'cuda:1']). With one GPU no collective is needed."
        )
    return devs


class DeviceGroup:
    """NCCL collectives across several CUDA devices of this process, from one thread.

    Example::

        dg = DeviceGroup([0, 1])
        dg.broadcast_([w0, w1], root=0, streams=[s0, s1])
    """

    def __init__(self, devices):
        self.devices = validate_devices(devices)
        self.size = len(self.devices)
        if not torch.cuda.is_available() or torch.cuda.device_count() <= max(d.index for d in self.devices):
            raise UnsupportedOpError(
                f"DeviceGroup({[str(d) for d in self.devices]}): this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s); "
                "check CUDA_VISIBLE_DEVICES or pass devices that exist"
            )
        import torch.cuda.nccl as nccl  # only importable usefully with CUDA

        if not nccl.is_available([torch.empty(1, device=d) for d in self.devices]):
            raise UnsupportedOpError("DeviceGroup: this torch build has no NCCL; install a CUDA build of torch")
        self._nccl = nccl

    def _check(self, tensors, streams, what: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if len(tensors) != self.size:
            raise CommArgumentError(f"{what}: expected {self.size} tensors (one per device), got {len(tensors)}")
        for t, d in zip(tensors, self.devices):
            if t.device != d:
                raise CommArgumentError(f"{what}: tensor for {d} is on {t.device}; order tensors like .devices")
            if not t.is_contiguous():
                raise CommArgumentError(f"{what}: tensors must be contiguous (call .contiguous() first)")
        shapes = {(tuple(t.shape), t.dtype) for t in tensors}
        if len(shapes) != 1:
            raise CommArgumentError(f"{what}: tensors differ in shape or dtype: {sorted(map(str, shapes))}")
        if streams is not None and len(list(streams)) != self.size:
            raise CommArgumentError(f"{what}: expected {self.size} streams (one per device), got {len(list(streams))}")
        return tensors

    def all_reduce_(self, tensors, op=ReduceOp.SUM, *, streams=None) -> None:
        """Reduce the per-device tensors in place; AVG as in :class:`ReduceOp` (integers floor-divide)."""
        tensors = self._check(tensors, streams, "DeviceGroup.all_reduce_")
        op = coerce_op(op)
        # same dtype rules as a Group; AVG sums in the tensors' own dtype here, then divides
        plan = plan_reduction(ReduceOp.SUM if op is ReduceOp.AVG else op, tensors[0].dtype, "nccl")
        if plan.complex_view or plan.wire_dtype != tensors[0].dtype:
            raise UnsupportedOpError(f"DeviceGroup.all_reduce_: dtype {tensors[0].dtype} is not supported by NCCL")
        nccl_op = _NCCL_OP[_BY_TORCH_OP[plan.torch_op]]  # bool SUM/PROD: the plan's MAX/MIN
        streams = list(streams) if streams is not None else None
        self._nccl.all_reduce(tensors, op=nccl_op, streams=streams)
        if op is ReduceOp.AVG:
            for i, t in enumerate(tensors):
                with torch.cuda.stream(streams[i]) if streams else torch.cuda.device(t.device):
                    if t.dtype.is_floating_point:
                        t.div_(self.size)
                    else:
                        t.copy_(torch.div(t, self.size, rounding_mode="floor"))

    def broadcast_(self, tensors, root: int, *, streams=None) -> None:
        """Overwrite every tensor with the one on ``devices[root]``."""
        tensors = self._check(tensors, streams, "DeviceGroup.broadcast_")
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidRankError(f"DeviceGroup.broadcast_: root {root!r} out of range 0..{self.size - 1}")
        # as bytes: NCCL has no int16, uint16/32/64 or complex type; a broadcast moves bytes of any dtype
        self._nccl.broadcast([t.view(-1).view(torch.uint8) for t in tensors], root=root,
                             streams=list(streams) if streams is not None else None)

    def split(self, *, timeout=timedelta(seconds=60)) -> list:
        """One NCCL :class:`Group` per device (rank i on ``devices[i]``), each for one thread."""
        from shardkit.comm.group import Group

        return Group._local_on(self.devices, "nccl", timeout)

"""Reduction operators and how each (op, dtype, backend) is carried out.

:class:`ReduceOp` is the public enum. :func:`plan_reduction` decides, as plain
data, which dtype travels on the wire, which torch op the backend runs and what
shardkit does to the result afterwards (e.g. divide for ``AVG``). It issues no
collective, so it is tested without any process group.

Example::

    >>> plan_reduction(ReduceOp.AVG, torch.int64, "gloo")
    ReductionPlan(wire_dtype=torch.int64, torch_op=<RedOpType.SUM: 0>, post='floor_div', complex_view=False)
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.errors import CommArgumentError, UnsupportedOpError

__all__ = ["ReduceOp", "ReductionPlan", "plan_reduction", "coerce_op", "BACKEND_DTYPES"]


class ReduceOp(enum.Enum):
    """Element-wise reduction applied across ranks; ``MEAN`` is an alias of ``AVG``.

    ``AVG`` on floating and complex tensors is the arithmetic mean. On integer
    tensors it is the sum floor-divided by the world size (rounds toward minus
    infinity, like Python's ``//``: ranks holding 1 and -2 give -1). On bool
    tensors ``SUM``/``MAX`` mean logical or, ``PROD``/``MIN`` logical and, and
    ``AVG`` is refused. ``AVG`` of narrow dtypes (8-32-bit integers, float16,
    bfloat16) sums in int64 or float32, so the sum does not overflow.

    Example::

        group.all_reduce_([grad], ReduceOp.AVG)
    """

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"
    MEAN = "avg"  # an alias: enum members with equal values are the same member


_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}

# Dtypes each backend reduces natively (torch 2.4–2.13). int16 is carried as
# int32: sums and products wrap the same way after the cast back.
BACKEND_DTYPES = {
    "gloo": frozenset({
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    }),
    "nccl": frozenset({
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    }),
}
_WIDENED = {torch.int16: torch.int32}
# AVG sums before it divides: narrow dtypes sum on a wide wire, so ranks holding 100 and 100
# in int8 (or 40000 in float16) average to 100 (40000), not to a wrapped (infinite) sum's half.
_AVG_WIRE = {torch.int8: torch.int64, torch.uint8: torch.int64, torch.int16: torch.int64,
             torch.int32: torch.int64, torch.float16: torch.float32, torch.bfloat16: torch.float32}
# Backends add and multiply bools as bytes (True + True = 2, wrapping to 0 at 256 ranks' worth).
_BOOL_OP = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}


@dataclass(frozen=True)
class ReductionPlan:
    """How one reduction runs: the wire dtype, the backend op and the fix-up after it."""

    wire_dtype: torch.dtype
    torch_op: object
    post: str | None  # None, "true_div" or "floor_div": divide by world size afterwards
    complex_view: bool  # complex tensors travel as their real view (..., 2)


def coerce_op(op) -> ReduceOp:
    """Accept a :class:`ReduceOp` or its name (``"sum"``, ``"MEAN"``); refuse anything else."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.upper()
        if key in ReduceOp.__members__:
            return ReduceOp[key]
    raise CommArgumentError(
        f"unknown reduce op {op!r}; use one of {sorted(ReduceOp.__members__)} "
        "(shardkit.comm.ReduceOp)"
    )


def plan_reduction(op: ReduceOp, dtype: torch.dtype, backend: str) -> ReductionPlan:
    """Decide how ``op`` on ``dtype`` runs on ``backend``; raise if it cannot run at all."""
    return _plan(coerce_op(op), dtype, backend)


@functools.lru_cache(maxsize=256)  # a handful of (op, dtype, backend) keys; refusals are not cached
def _plan(op: ReduceOp, dtype: torch.dtype, backend: str) -> ReductionPlan:
    if dtype.is_complex:
        return _plan_complex(op, dtype)
    wire = _WIDENED.get(dtype, dtype)
    if wire not in BACKEND_DTYPES.get(backend, BACKEND_DTYPES["gloo"]):
        supported = sorted(str(d).replace("torch.", "") for d in BACKEND_DTYPES["gloo"])
        raise UnsupportedOpError(
            f"{backend} cannot reduce tensors of dtype {dtype}; supported: {supported}, "
            "int16 and complex64/128. Cast the tensor (e.g. .float()) before reducing."
        )
    if op is not ReduceOp.AVG:
        if dtype == torch.bool:
            op = _BOOL_OP.get(op, op)  # logical or / and
        return ReductionPlan(wire, _TORCH_OP[op], None, False)
    if dtype == torch.bool:
        raise UnsupportedOpError(
            "ReduceOp.AVG is not defined for bool tensors; use MAX (any rank true) "
            "or MIN (all ranks true), or cast to a number first."
        )
    if dtype.is_floating_point and backend == "nccl":
        return ReductionPlan(wire, dist.ReduceOp.AVG, None, False)
    # Gloo before torch 2.13 has no AVG, and integer AVG needs a defined rounding.
    post = "true_div" if dtype.is_floating_point else "floor_div"
    return ReductionPlan(_AVG_WIRE.get(dtype, wire), dist.ReduceOp.SUM, post, False)


def _plan_complex(op: ReduceOp, dtype: torch.dtype) -> ReductionPlan:
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise UnsupportedOpError(
            f"ReduceOp.{op.name} has no meaning for complex tensors ({dtype}); "
            "only SUM and AVG are supported. Reduce .real / .imag separately if you need it."
        )
    post = "true_div" if op is ReduceOp.AVG else None
    real = torch.float32 if dtype == torch.complex64 else torch.float64
    return ReductionPlan(real, dist.ReduceOp.SUM, post, True)


def to_wire(tensor: torch.Tensor, plan: ReductionPlan) -> torch.Tensor:
    """The tensor the backend reduces: a view when possible, else a converted copy."""
    if plan.complex_view:
        return torch.view_as_real(tensor)
    if tensor.dtype != plan.wire_dtype:
        return tensor.to(plan.wire_dtype)
    return tensor


def finish(wire: torch.Tensor, target: torch.Tensor, plan: ReductionPlan, world_size: int) -> None:
    """Apply the plan's fix-up to ``wire`` and make sure ``target`` holds the result."""
    if plan.post == "true_div":
        wire.div_(world_size)
    elif plan.post == "floor_div":
        wire.copy_(torch.div(wire, world_size, rounding_mode="floor"))
    if not plan.complex_view and wire.data_ptr() != target.data_ptr():
        target.copy_(wire)

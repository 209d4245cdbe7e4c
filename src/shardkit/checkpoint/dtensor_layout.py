"""The box of the global tensor that this rank holds: DTensor leaves carry their layout.

A ``DTensor`` (FSDP2, HSDP, tensor parallel, 2-D meshes, including the
strided sharding FSDP2 applies over TP) holds one box of its global tensor;
torch's own ``compute_local_shape_and_global_offset`` (what
``torch.distributed.checkpoint`` uses) gives its offsets and sizes. A plain
tensor is replicated: its box is the whole tensor. This module reads
layouts only; it moves no data and issues no collective.

Example::

    box, local = local_box(model.state_dict()["w"])     # a DTensor on a mesh of 4
    box.offsets, box.sizes, local.shape                 # (2, 0), (2, 8), torch.Size([2, 8])
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardkit.errors import TensorMismatchError
from shardkit.layout import Box, whole_box

__all__ = ["is_dtensor", "local_box", "global_shape"]


def is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def local_box(name: str, t: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """``(box of the global tensor this rank holds, the local tensor holding it)``.

    A rank outside a DTensor's mesh holds an empty box. Raises
    :class:`TensorMismatchError` when a DTensor's local tensor does not have
    the shape its placements give it (a partial, un-reduced DTensor, say).
    """
    if not isinstance(t, DTensor):
        return whole_box(tuple(t.shape)), t
    local = t.to_local()
    if any(p.is_partial() for p in t.placements):
        raise TensorMismatchError(f"tensor {name!r} is a DTensor with a Partial placement {t.placements}; its "
                                  f"values are not reduced yet. Redistribute it to Shard/Replicate before saving")
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    sizes, offsets = tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)
    if t.device_mesh.get_coordinate() is None:
        return Box(tuple(0 for _ in t.shape), tuple(0 for _ in t.shape)), local
    if tuple(local.shape) != sizes:
        raise TensorMismatchError(f"DTensor {name!r} has a local tensor of shape {list(local.shape)}, but its "
                                  f"placements {t.placements} give this rank {list(sizes)} at {list(offsets)}")
    return Box(offsets, sizes), local

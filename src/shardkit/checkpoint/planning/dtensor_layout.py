"""The box of the global tensor that this rank holds: DTensor leaves carry their layout.

A ``DTensor`` (FSDP2, HSDP, tensor parallel, 2-D meshes, including the
strided sharding FSDP2 applies over TP) holds one box of its global tensor;
torch's own ``compute_local_shape_and_global_offset`` (what
``torch.distributed.checkpoint`` uses) gives its offsets and sizes. A plain
tensor is replicated: its box is the whole tensor. :func:`predicted_box`
gives the box of *any* mesh coordinate from plain data (torch's private
``_compute_local_shape_and_global_offset``, imported defensively: None where
a torch lacks it), so one rank can compute every rank's box. This module
reads layouts only; it moves no data and issues no collective.

Example::

    box, local = local_box(model.state_dict()["w"])     # a DTensor on a mesh of 4
    box.offsets, box.sizes, local.shape                 # (2, 0), (2, 8), torch.Size([2, 8])
    predicted_box((8, 8), (4,), (1,), (Shard(0),))      # Box((2, 0), (2, 8))
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import types

import torch

from shardkit.errors import TensorMismatchError
from shardkit.layout import Box, cover_problem, whole_box

_DTENSOR_PACKAGE = "torch.distributed.tensor"


@functools.cache
def _dtensor_api() -> types.SimpleNamespace:
    """torch's DTensor names, imported on first use: importing them costs over a second (sympy), and a
    process that never made a DTensor never needs them (``import shardkit.checkpoint`` stays quick)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    try:  # private torch API: without it every box is exchanged instead of computed
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as predict
    except ImportError:  # pragma: no cover - depends on the torch version
        predict = None
    try:
        from torch.distributed.tensor.placement_types import _StridedShard as strided
    except ImportError:  # pragma: no cover - depends on the torch version
        strided = None
    return types.SimpleNamespace(DTensor=DTensor, Replicate=Replicate, Shard=Shard, StridedShard=strided,
                                 local_shape_and_offset=compute_local_shape_and_global_offset,
                                 predict=predict)


__all__ = ["is_dtensor", "local_box", "outside_mesh", "global_shape", "placement_code", "is_shard",
           "is_known_placement", "tiles_by_construction", "predicted_box"]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (without importing torch's DTensor package when no DTensor can exist)."""
    return _DTENSOR_PACKAGE in sys.modules and isinstance(t, _dtensor_api().DTensor)


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def local_box(name: str, t: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """``(box of the global tensor this rank holds, the local tensor holding it)``.

    A rank outside a DTensor's mesh holds an empty box. Raises
    :class:`TensorMismatchError` when a DTensor's local tensor does not have
    the shape its placements give it (a partial, un-reduced DTensor, say).
    """
    if not is_dtensor(t):
        return whole_box(tuple(t.shape)), t
    local = t.to_local()
    if any(p.is_partial() for p in t.placements):
        raise TensorMismatchError(f"tensor {name!r} is a DTensor with a Partial placement {t.placements}; its "
                                  f"values are not reduced yet. Redistribute it to Shard/Replicate before saving")
    _check_layout(name, t)
    if outside_mesh(t):
        return Box(tuple(0 for _ in t.shape), tuple(0 for _ in t.shape)), local
    sizes, offsets = _dtensor_api().local_shape_and_offset(t.shape, t.device_mesh, t.placements)
    sizes, offsets = tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)
    if tuple(local.shape) != sizes:
        raise TensorMismatchError(f"DTensor {name!r} has a local tensor of shape {list(local.shape)}, but its "
                                  f"placements {t.placements} give this rank {list(sizes)} at {list(offsets)}")
    return Box(offsets, sizes), local


def outside_mesh(t: torch.Tensor) -> bool:
    """A DTensor whose mesh this rank is not part of: it holds nothing of the tensor."""
    return is_dtensor(t) and t.device_mesh.get_coordinate() is None


def _check_layout(name: str, t) -> None:
    """Refuse placements whose local parts are not one box each: one box per rank is what is saved and filled."""
    unknown = [p for p in t.placements if not is_known_placement(p)]
    if unknown:
        raise TensorMismatchError(
            f"tensor {name!r} is a DTensor with placement(s) {unknown} that shardkit cannot lay out (it knows "
            "Shard, Replicate and the _StridedShard FSDP2 puts over tensor parallelism); redistribute it to "
            "Shard/Replicate first. Nothing was written or read.")
    if all(map(tiles_by_construction, t.placements)):
        return
    if not _boxes_tile(tuple(t.shape), tuple(t.device_mesh.shape), tuple(t.placements)):
        raise TensorMismatchError(
            f"tensor {name!r} is a DTensor whose placements {tuple(t.placements)} on a mesh of "
            f"{tuple(t.device_mesh.shape)} give a rank parts of the tensor that are not one contiguous box (strided "
            "sharding whose rows interleave); shardkit saves and fills one box per rank. Redistribute it (e.g. to "
            "the FSDP2 + tensor-parallel order torch produces, or to Shard/Replicate). Nothing was written or read.")


@functools.lru_cache(maxsize=256)
def _boxes_tile(shape, mesh_shape, placements) -> bool:
    # The boxes of every mesh coordinate must cover the tensor once, replicas aside, else some
    # rank's part is not one box (torch gives such a rank the box of its first rows only).
    boxes = {predicted_box(shape, mesh_shape, c, placements) for c in itertools.product(*map(range, mesh_shape))}
    if None in boxes:
        return False
    return cover_problem(shape, [b for b in boxes if math.prod(b.sizes)]) is None


def is_shard(p) -> bool:
    """A placement that splits a tensor dimension over a mesh dimension (``Shard`` or ``_StridedShard``)."""
    api = _dtensor_api()
    return isinstance(p, api.Shard) or (api.StridedShard is not None and isinstance(p, api.StridedShard))


def is_known_placement(p) -> bool:
    """``Shard``, ``_StridedShard`` or ``Replicate``: placements :func:`predicted_box` handles."""
    return is_shard(p) or isinstance(p, _dtensor_api().Replicate)


def tiles_by_construction(p) -> bool:
    """Exactly ``Shard`` or ``Replicate``: the boxes of any mesh of these tile the tensor (each mesh
    dimension splits a tensor dimension into contiguous chunks as ``torch.chunk`` does)."""
    api = _dtensor_api()
    return type(p) is api.Shard or type(p) is api.Replicate


def placement_code(p) -> list:
    """A JSON value naming placement ``p`` exactly (equal codes: equal boxes on every coordinate)."""
    api = _dtensor_api()
    if api.StridedShard is not None and isinstance(p, api.StridedShard):
        return ["SS", int(p.dim), int(p.split_factor)]
    if type(p) is api.Shard:
        return ["S", int(p.dim)]
    if type(p) is api.Replicate:
        return ["R"]
    return ["?", type(p).__qualname__, repr(p)]


def predicted_box(global_shape, mesh_shape, coordinate, placements) -> Box | None:
    """The box that mesh ``coordinate`` holds of a DTensor of ``global_shape`` with ``placements``
    on a mesh of ``mesh_shape`` (a coordinate of None: a rank outside the mesh, an empty box).

    None when torch lacks the private helper, or a placement is not one it handles.
    """
    ndim = len(global_shape)
    if coordinate is None:
        return Box((0,) * ndim, (0,) * ndim)
    predict = _dtensor_api().predict
    if predict is None or not all(map(is_known_placement, placements)):
        return None
    try:
        sizes, offsets = predict(tuple(global_shape), tuple(mesh_shape),
                                                                list(coordinate), tuple(placements))
    except Exception:  # noqa: BLE001 - a layout torch cannot compute is one not to predict
        return None
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))

"""A chunked save's layout in O(tensors + meshes) words, the same on every rank of a correct save.

Each tensor is described by its global shape, its dtype and how the ranks
hold it (``kind``):

- ``plain``: a plain tensor, replicated: every rank holds the whole tensor;
- ``row``: a ``rank_state`` tensor of shape ``(world_size, ...)``: rank r holds row r;
- ``mesh``: a DTensor: its mesh (shape and global ranks, listed once per
  distinct mesh in ``meshes``) and its placements.

Every rank's box of every tensor follows from this description and each
rank's global rank (its mesh coordinates), so ``chunked_save.prepare``
exchanges only the description's digest and O(1) facts per rank instead of
every rank's box of every tensor. Each rank checks its own predicted boxes
against the boxes it holds (:func:`own_boxes_agree`); every rank then
decides the same way whether the prediction is safe to plan from
(:func:`prediction_trusted`); when it is not, the save falls back to the full
exchange of boxes (``chunk_plan.plan_chunks``), whose errors name the
disagreement. This module moves no data and issues no collective; it never
chooses writers (``writer_choice.py``).

Example::

    desc = describe(flat.tensors, rows, world_size)       # one per rank, equal on every rank
    desc.digest()                                          # what the ranks compare
    desc.box(name, coordinate_of_rank)                     # any rank's box
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import xxhash

from shardkit.checkpoint.format.chunks import Chunk, check_cover
from shardkit.checkpoint.planning.dtensor_layout import (
    is_dtensor, is_known_placement, is_shard, placement_code, predicted_box, tiles_by_construction,
)
from shardkit.dtypes import NAME_TO_DTYPE, to_safetensors_name
from shardkit.errors import MetadataError
from shardkit.layout import Box, whole_box

__all__ = ["MeshInfo", "TensorLayout", "Description", "describe", "own_boxes_agree", "prediction_trusted",
           "coordinate_map", "shard_coordinates"]


@dataclass(frozen=True)
class MeshInfo:
    """A device mesh as plain data: its shape and its global ranks in row-major order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @cached_property
    def _index(self) -> dict[int, int]:
        return {g: i for i, g in enumerate(self.ranks)}

    def coordinate(self, global_rank: int | None) -> tuple[int, ...] | None:
        """The mesh coordinate of ``global_rank`` (None: not in this mesh)."""
        i = self._index.get(global_rank) if global_rank is not None else None
        return None if i is None else _unravel(i, self.shape)

    def global_rank(self, coordinate: tuple[int, ...]) -> int:
        return self.ranks[_ravel(coordinate, self.shape)]


@dataclass(frozen=True)
class TensorLayout:
    full_shape: tuple[int, ...]
    dtype: str                       # safetensors dtype name
    kind: str                        # "plain", "row" or "mesh"
    mesh: int = -1                   # index into Description.meshes (kind "mesh")
    placements: tuple = ()           # torch placements (kind "mesh"); not part of the JSON
    codes: tuple = ()                # their JSON codes (``placement_code``)

    @property
    def nbytes(self) -> int:
        return math.prod(self.full_shape) * NAME_TO_DTYPE[self.dtype].itemsize

    def shard_dims(self) -> list[int]:
        return [d for d, p in enumerate(self.placements) if is_shard(p)]

    def replicate_dims(self) -> list[int]:
        return [d for d, p in enumerate(self.placements) if not is_shard(p)]


@dataclass
class Description:
    """Every tensor's layout (sorted by name) and the distinct meshes they live on."""

    tensors: dict[str, TensorLayout]
    meshes: list[MeshInfo]
    mesh_objects: list = field(default_factory=list, repr=False)   # this rank's DeviceMesh per entry of meshes
    _boxes: dict = field(default_factory=dict, repr=False)          # (name, coordinate) -> Box cache

    def to_json(self) -> list:
        tensors = [[n, list(t.full_shape), t.dtype, t.kind, t.mesh, [list(c) for c in t.codes]]
                   for n, t in self.tensors.items()]
        return [tensors, [[list(m.shape), list(m.ranks)] for m in self.meshes]]

    def digest(self) -> str:
        """xxh3-128 of the canonical JSON: equal on every rank of a correct save."""
        return xxhash.xxh3_128_hexdigest(json.dumps(self.to_json(), separators=(",", ":")).encode())

    def box(self, name: str, coordinate: tuple[int, ...] | None) -> Box | None:
        """The box of mesh tensor ``name`` that mesh ``coordinate`` holds (cached by signature)."""
        t = self.tensors[name]
        key = (t.full_shape, t.mesh, t.codes, coordinate)
        if key not in self._boxes:
            self._boxes[key] = predicted_box(t.full_shape, self.meshes[t.mesh].shape, coordinate, t.placements)
        return self._boxes[key]


def describe(tensors: dict[str, torch.Tensor], rows: dict[str, torch.Tensor], world_size: int) -> Description:
    """This rank's description of ``tensors`` (the flat state; plain or DTensor) and ``rows``
    (``rank_state`` tensors by their saved names, each this rank's row: shape ``(1, ...)``)."""
    meshes: list[MeshInfo] = []
    objects: list = []
    index_of_object: dict[int, int] = {}
    index_of_info: dict[MeshInfo, int] = {}
    out: dict[str, TensorLayout] = {}
    for name in sorted([*tensors, *rows]):
        if name in rows:
            t = rows[name]
            out[name] = TensorLayout((world_size, *t.shape[1:]), to_safetensors_name(t.dtype), "row")
            continue
        t = tensors[name]
        dtype = to_safetensors_name(t.dtype)
        if not is_dtensor(t):
            out[name] = TensorLayout(tuple(t.shape), dtype, "plain")
            continue
        mesh = t.device_mesh
        if id(mesh) not in index_of_object:
            info = MeshInfo(tuple(int(s) for s in mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()))
            if info not in index_of_info:
                index_of_info[info] = len(meshes)
                meshes.append(info)
                objects.append(mesh)
            index_of_object[id(mesh)] = index_of_info[info]
        placements = tuple(t.placements)
        out[name] = TensorLayout(tuple(t.shape), dtype, "mesh", index_of_object[id(mesh)], placements,
                                 tuple(tuple(placement_code(p)) for p in placements))
    return Description(out, meshes, objects)


def own_boxes_agree(desc: Description, boxes: dict[str, Box], global_rank: int | None, rank: int) -> bool:
    """True when every box this rank holds (``boxes``, from ``local_box``) is the one the
    description predicts for it: O(this rank's tensors + its meshes' sizes)."""
    coordinates = []
    for info, mesh in zip(desc.meshes, desc.mesh_objects):
        mine = info.coordinate(global_rank)
        seen = mesh.get_coordinate()
        if (None if seen is None else tuple(int(c) for c in seen)) != mine:
            return False
        coordinates.append(mine)
    for name, t in desc.tensors.items():
        if t.kind == "plain":
            want = whole_box(t.full_shape)
        elif t.kind == "row":
            want = Box((rank,) + (0,) * (len(t.full_shape) - 1), (1, *t.full_shape[1:]))
        else:
            want = desc.box(name, coordinates[t.mesh])
        if want is None or tuple(want) != tuple(boxes[name]):
            return False
    return True


def coordinate_map(desc: Description, global_ranks: list[int | None]) -> dict[int, int] | None:
    """``global rank -> coordinator rank`` for the mesh members, or None when some mesh member is not
    exactly one saving rank (then the boxes cannot be predicted: fall back)."""
    if not desc.meshes:
        return {}
    by_global: dict[int, int] = {}
    for rank, g in enumerate(global_ranks):
        if g is None or g in by_global:
            return None
        by_global[g] = rank
    if any(g not in by_global for m in desc.meshes for g in m.ranks):
        return None
    return by_global


def prediction_trusted(desc: Description, global_ranks: list[int | None]) -> bool:
    """Whether the predicted boxes tile every tensor, every mesh member saving: rank 0 answers from
    every rank's gathered facts and tells the others (``chunked_save.prepare``). Shard / Replicate layouts tile by construction (each
    mesh dimension splits a tensor dimension as ``torch.chunk`` does); any other placement
    (``_StridedShard``) is checked box by box once per distinct layout."""
    if coordinate_map(desc, global_ranks) is None:
        return False
    checked: dict[tuple, bool] = {}
    for name, t in desc.tensors.items():
        if t.kind != "mesh" or all(map(tiles_by_construction, t.placements)):
            continue
        key = (t.full_shape, t.mesh, t.codes)
        if key not in checked:
            checked[key] = _tiles(desc, name)
        if not checked[key]:
            return False
    return True


def shard_coordinates(desc: Description, name: str):
    """Every coordinate of ``name``'s mesh whose replicated dimensions are 0: one per distinct box."""
    t = desc.tensors[name]
    shape = desc.meshes[t.mesh].shape
    shard = set(t.shard_dims())
    return itertools.product(*(range(n) if d in shard else (0,) for d, n in enumerate(shape)))


def _tiles(desc: Description, name: str) -> bool:
    t = desc.tensors[name]
    if not all(map(is_known_placement, t.placements)):
        return False
    boxes = [desc.box(name, c) for c in shard_coordinates(desc, name)]
    if any(b is None for b in boxes):
        return False
    chunks = [Chunk(f"box{i}", b.offsets, b.sizes, 0, 0) for i, b in enumerate(boxes) if math.prod(b.sizes)]
    try:
        check_cover(name, t.full_shape, chunks, source="the predicted layout")
    except MetadataError:
        return False
    return True


def _ravel(coordinate, shape) -> int:
    i = 0
    for c, n in zip(coordinate, shape):
        i = i * n + c
    return i


def _unravel(i: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        i, c = divmod(i, n)
        out.append(c)
    return tuple(reversed(out))

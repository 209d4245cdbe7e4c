"""Rank 0's plan of an agreed chunked save as grids: O(tensors + ranks), never one object per chunk.

When every rank agreed on the compact layout (``compact_layout.py``),
rank 0 describes each tensor's stored chunks as a :class:`Grid`
(``compact_manifest.py``) straight from the description, with the same
writers ``writer_choice`` gives (the same rules, evaluated per distinct
layout instead of per chunk):

- a plain (replicated) tensor: one cell, in its writer's file;
- a ``rank_state`` row tensor: dimension 0 cut into one row per rank, row r in rank r's file;
- a DTensor on ``Shard`` / ``Replicate`` placements: each tensor dimension
  cut by ``torch.chunk`` over the mesh dimensions that shard it, in mesh
  order (``ChunkSplit``); the writer of each cell from the replica rotation.
  The rank array of a mesh layout is computed once per (mesh, placements,
  rotation) and shared by every tensor with that layout.

A save with any other DTensor (``_StridedShard``) is not planned here
(:func:`grid_plan` returns None): it is planned box by box
(``writer_choice.full_plan``) and its grids found from the boxes. The plan
also gives each rank's data bytes (vectorized), which the commit checks
every written file against. No I/O, no collectives.

Example::

    plan = grid_plan(desc, global_ranks, world_size)
    plan.tensors["model.w"]        # ((4096, 1024), "BF16", Grid(...))
    plan.data_bytes[3]             # bytes of tensor data in rank_3.safetensors
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardkit.checkpoint.planning.compact_layout import Description, TensorLayout, coordinate_map, shard_coordinates
from shardkit.checkpoint.format.compact_manifest import Grid, affine_or_ranks
from shardkit.checkpoint.planning.dtensor_layout import is_shard, tiles_by_construction
from shardkit.checkpoint.format.grid_split import ChunkSplit
from shardkit.checkpoint.planning.writer_choice import plain_writers, replica_turns, writer_coordinate
from shardkit.dtypes import NAME_TO_DTYPE
from shardkit.errors import MetadataError

__all__ = ["GridPlan", "grid_plan"]


@dataclass
class GridPlan:
    """Per tensor: its full shape, dtype and :class:`Grid` (None: the tensor has no element, no chunk)."""

    tensors: dict[str, tuple[tuple[int, ...], str, Grid | None]]
    data_bytes: np.ndarray       # rank -> bytes of tensor data its file holds


def grid_plan(desc: Description, global_ranks: list[int | None], world_size: int) -> GridPlan | None:
    """The whole save as grids (see the module docstring), or None when some tensor's layout is not a
    grid by construction (then plan it box by box: ``writer_choice.full_plan``)."""
    by_global = coordinate_map(desc, global_ranks)
    if by_global is None:
        raise MetadataError("the compact layout names mesh ranks that are not exactly one saving rank each; "
                            "it cannot be planned from (the save should have fallen back to the full exchange)")
    if any(t.kind == "mesh" and not all(map(tiles_by_construction, t.placements)) for t in desc.tensors.values()):
        return None
    plain = plain_writers(desc, world_size)
    turns = replica_turns(desc)
    rank_arrays: dict[tuple, np.ndarray] = {}
    grids: dict[tuple, Grid] = {}            # tensors of one shape and layout share their grid ...
    grid_bytes: dict[tuple, np.ndarray] = {}  # ... and its bytes per rank
    data_bytes = np.zeros(world_size, dtype=np.int64)
    out = {}
    for name, t in desc.tensors.items():
        grid = None
        if math.prod(t.full_shape):
            grid = _grid(desc, name, t, plain, turns, by_global, world_size, rank_arrays, grids)
            key = (grid, NAME_TO_DTYPE[t.dtype].itemsize)
            if key not in grid_bytes:
                grid_bytes[key] = grid.bytes_per_rank(key[1], world_size)
            data_bytes += grid_bytes[key]
        out[name] = (t.full_shape, t.dtype, grid)
    return GridPlan(out, data_bytes)


def _grid(desc: Description, name: str, t: TensorLayout, plain, turns, by_global, world_size,
          cache: dict, grids: dict) -> Grid:
    ndim = len(t.full_shape)
    if t.kind == "plain":
        return Grid(t.full_shape, tuple(ChunkSplit(n) for n in t.full_shape), plain[name], (0,) * ndim)
    if t.kind == "row":
        splits = (ChunkSplit(world_size, (world_size,)), *(ChunkSplit(n) for n in t.full_shape[1:]))
        return Grid(t.full_shape, splits, 0, (1,) + (0,) * (ndim - 1))
    mesh_shape = desc.meshes[t.mesh].shape
    sharding = [[m for m, p in enumerate(t.placements) if is_shard(p) and p.dim == d] for d in range(ndim)]
    splits = tuple(ChunkSplit(n, tuple(mesh_shape[m] for m in ms)) for n, ms in zip(t.full_shape, sharding))
    replicas = math.prod(mesh_shape[m] for m in t.replicate_dims())
    key = (t.mesh, t.codes, ndim, turns[name] % replicas)
    if key not in cache:
        cache[key] = _rank_array(desc, name, t, sharding, splits, by_global, turns[name])
    if (key, t.full_shape) not in grids:
        grids[key, t.full_shape] = affine_or_ranks(t.full_shape, splits, cache[key], world_size)
    return grids[key, t.full_shape]


def _rank_array(desc: Description, name: str, t: TensorLayout, sharding, splits, by_global, turn: int) -> np.ndarray:
    """The writer (coordinator rank) of every cell of the grid, empty cells included: O(mesh size)."""
    mesh = desc.meshes[t.mesh]
    ranks = np.full([s.count for s in splits], -1, dtype=np.int64)
    for c in shard_coordinates(desc, name):
        cell = []
        for ms in sharding:
            i = 0
            for m in ms:
                i = i * mesh.shape[m] + c[m]
            cell.append(i)
        ranks[tuple(cell)] = by_global[mesh.global_rank(writer_coordinate(t, mesh.shape, c, turn))]
    return ranks

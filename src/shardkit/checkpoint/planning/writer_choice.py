"""Who writes each distinct box of a chunked save, from the compact layout (``compact_layout.py``).

Every rank computes its own writes in O(its tensors + ranks)
(:func:`own_writes`); rank 0 computes the whole plan for the manifest
(:func:`full_plan`, O(chunks)). The rules are deterministic, so both agree:

- a box held by one rank is written by it (a sharded DTensor's box, a
  ``rank_state`` row);
- replicated plain tensors (every rank holds them) are spread over the ranks
  by bytes: largest first (then by name), each to the rank with the fewest
  such bytes so far (ties: the lower rank);
- a DTensor box held by several ranks (its ``Replicate`` mesh dimensions:
  HSDP's replica dimension, a TP mesh's replicated parameters) rotates over
  its replicas: the DTensors sharing a mesh and replicated dimensions are
  taken largest first (then by name), and the k-th of them has the box of
  shard index s (its coordinate over the sharded mesh dimensions, row-major)
  written by replica (k + s) mod replicas.

This module only chooses; it checks no agreement between ranks (``prepare``
does) and plans nothing for a fallback save (``chunk_plan.plan_chunks``).

Example::

    own_writes(desc, rank, world_size, global_rank, boxes)    # ["model.w", ...] this rank writes
    full_plan(desc, global_ranks, world_size).writes[3]      # what rank 3 writes
"""

from __future__ import annotations

import heapq
import math

from shardkit.checkpoint.planning.chunk_plan import ChunkedTensor, ChunkPlan, check_tiling
from shardkit.checkpoint.planning.dtensor_layout import is_shard
from shardkit.checkpoint.planning.compact_layout import Description, TensorLayout, coordinate_map, shard_coordinates
from shardkit.errors import MetadataError
from shardkit.layout import Box

__all__ = ["own_writes", "full_plan", "plain_writers", "spread_by_bytes", "replica_turns", "writer_coordinate"]


def plain_writers(desc: Description, world_size: int) -> dict[str, int]:
    """``name -> writer`` of every non-empty replicated plain tensor (greedy by bytes, O(P log W + W))."""
    return spread_by_bytes({n: t.nbytes for n, t in desc.tensors.items() if t.kind == "plain"}, world_size)


def spread_by_bytes(nbytes: dict[str, int], world_size: int) -> dict[str, int]:
    """``name -> writer`` for replicated tensors of ``nbytes`` bytes each: largest first (then by name),
    each to the rank with the fewest such bytes so far (ties: the lower rank). Empty ones get no writer.

    >>> spread_by_bytes({"a": 8, "b": 4, "c": 4, "e": 0}, 2)
    {'a': 0, 'b': 1, 'c': 1}
    """
    items = sorted((-b, n) for n, b in nbytes.items() if b)
    heap = [(0, r) for r in range(world_size)]          # sorted, hence a heap
    out = {}
    for neg_bytes, name in items:
        load, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (load - neg_bytes, rank))
    return out


def replica_turns(desc: Description) -> dict[str, int]:
    """``name -> k``: each DTensor's place among those sharing its mesh and replicated dimensions."""
    classes: dict[tuple, list] = {}
    for n, t in desc.tensors.items():
        if t.kind == "mesh":
            classes.setdefault((t.mesh, tuple(t.replicate_dims())), []).append((-t.nbytes, n))
    return {n: k for members in classes.values() for k, (_, n) in enumerate(sorted(members))}


def _split(t: TensorLayout, mesh_shape, coordinate) -> tuple[int, int, int]:
    """``(shard index, replica index, replicas)`` of a mesh coordinate for tensor layout ``t``."""
    shard = replica = 0
    replicas = 1
    for d, p in enumerate(t.placements):
        if is_shard(p):
            shard = shard * mesh_shape[d] + coordinate[d]
        else:
            replica = replica * mesh_shape[d] + coordinate[d]
            replicas *= mesh_shape[d]
    return shard, replica, replicas


def writer_coordinate(t: TensorLayout, mesh_shape, shard_coordinate, turn: int) -> tuple[int, ...]:
    shard, _, replicas = _split(t, mesh_shape, shard_coordinate)
    replica = (turn + shard) % replicas
    out = list(shard_coordinate)
    for d in reversed(t.replicate_dims()):
        replica, out[d] = divmod(replica, mesh_shape[d])
    return tuple(out)


def own_writes(desc: Description, rank: int, world_size: int, global_rank: int | None,
               boxes: dict[str, Box]) -> list[str]:
    """The tensors this rank writes (its own box of each), given the boxes it holds."""
    plain = plain_writers(desc, world_size)
    turns = replica_turns(desc)
    coordinates = [m.coordinate(global_rank) for m in desc.meshes]
    out = []
    for name, t in desc.tensors.items():
        if not math.prod(boxes[name].sizes):
            continue
        if t.kind == "plain":
            mine = plain.get(name) == rank
        elif t.kind == "row":
            mine = True
        else:
            c = coordinates[t.mesh]
            if c is None:
                continue
            shard, replica, replicas = _split(t, desc.meshes[t.mesh].shape, c)
            mine = replica == (turns[name] + shard) % replicas
        if mine:
            out.append(name)
    return out


def full_plan(desc: Description, global_ranks: list[int | None], world_size: int,
              names: list[str] | None = None) -> ChunkPlan:
    """Every distinct non-empty box of every tensor (of ``names`` only, when given) with its writer, and
    what each rank writes.

    Raises :class:`MetadataError` if the boxes do not tile a tensor or one box is predicted twice
    (never for a layout ``prediction_trusted`` accepted)."""
    by_global = coordinate_map(desc, global_ranks)
    if by_global is None:
        raise MetadataError("the compact layout names mesh ranks that are not exactly one saving rank each; "
                            "it cannot be planned from (the save should have fallen back to the full exchange)")
    plain = plain_writers(desc, world_size)
    turns = replica_turns(desc)
    tensors, writes = {}, [[] for _ in range(world_size)]
    for name, t in desc.tensors.items():
        if names is not None and name not in names:
            continue
        chosen = _chosen(desc, name, t, plain, turns, by_global, world_size)
        check_tiling(name, t.full_shape, chosen)
        tensors[name] = ChunkedTensor(t.full_shape, t.dtype, chosen)
        for rank in chosen.values():
            writes[rank].append(name)
    return ChunkPlan(tensors, writes)


def _chosen(desc: Description, name: str, t: TensorLayout, plain, turns, by_global, world_size) -> dict[Box, int]:
    if t.kind == "plain":
        return {Box((0,) * len(t.full_shape), t.full_shape): plain[name]} if name in plain else {}
    if t.kind == "row":
        if not math.prod(t.full_shape[1:]):
            return {}
        rest = t.full_shape[1:]
        return {Box((r,) + (0,) * len(rest), (1, *rest)): r for r in range(world_size)}
    mesh = desc.meshes[t.mesh]
    chosen: dict[Box, int] = {}
    for c in shard_coordinates(desc, name):
        box = desc.box(name, c)
        if box is None or not math.prod(box.sizes):
            continue
        if box in chosen:
            raise MetadataError(f"tensor {name!r}: two mesh coordinates are predicted to hold the box at "
                                f"{list(box.offsets)}; its layout {t.codes} cannot be planned from the prediction")
        chosen[box] = by_global[mesh.global_rank(writer_coordinate(t, mesh.shape, c, turns[name]))]
    return chosen

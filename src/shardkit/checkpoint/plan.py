"""Save and load plans, as plain data (habit 1: plan first, then do I/O).

- :func:`plan_save` decides what each rank writes: its slice of every
  sharded tensor, and the replicated tensors it *owns*. Owners are spread
  greedily by bytes (largest tensor first, to the rank with the fewest
  replicated bytes so far), so replicated state is written once and in
  parallel. Every rank computes the same plan from the same names and sizes.
- :func:`plan_load` decides, for each wanted tensor box, which saved chunks
  (file, box) overlap it and the exact element reads (:class:`~shardkit.layout.Piece`).

Sizes come in as plain ints and dtype widths through a callable, so these
functions are tested without tensors or a disk (habit 2).

Example::

    plan = plan_save({"w": 64, "b": 8}, {"w": spec}, rank=0, world_size=2)
    loads = plan_load(saved, {"w": Box((0,), (8,))}, lambda name: 1 << 20)
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Callable, Container, Iterator, Mapping

from shardkit.checkpoint.manifest import SavedTensor, data_file_name
from shardkit.checkpoint.spec import TensorShardSpec
from shardkit.layout import (
    Box,
    Piece,
    compute_shard_sizes,
    overlapping_chunks,
    plan_box_reads,
    shard_box,
    shard_offsets,
    whole_box,
)

__all__ = ["SavePlan", "plan_save", "ChunkRead", "TensorLoad", "wanted_box", "plan_load", "saved_chunks",
           "chunks_by_file", "overlapping_saved_chunks", "nonempty_chunk_files"]


@dataclass(frozen=True)
class SavePlan:
    """What one rank writes: ``write_names`` (sharded slices + owned replicated tensors)."""

    rank: int
    world_size: int
    owner_of: dict[str, int]        # replicated name -> the rank that writes it
    write_names: list[str]


def plan_save(name_to_nbytes: Mapping[str, int], specs: Mapping[str, TensorShardSpec], rank: int,
              world_size: int) -> SavePlan:
    """The save plan of ``rank``; names absent from ``specs`` (or with shard_dim None) are replicated."""
    replicated = [n for n in name_to_nbytes if n not in specs or specs[n].shard_dim is None]
    owner_of = _spread_owners({n: name_to_nbytes[n] for n in replicated}, world_size)
    write = [n for n in name_to_nbytes if n not in owner_of or owner_of[n] == rank]
    return SavePlan(rank, world_size, owner_of, write)


def _spread_owners(name_to_nbytes: Mapping[str, int], world_size: int) -> dict[str, int]:
    load = [0] * world_size
    owner_of = {}
    for name in sorted(name_to_nbytes, key=lambda n: (-name_to_nbytes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner_of[name] = rank
        load[rank] += max(name_to_nbytes[name], 1)  # count empty tensors too, so they spread
    return owner_of


@dataclass(frozen=True)
class ChunkRead:
    """Reads from one saved chunk: ``file`` holds it under the tensor's name."""

    file: str
    chunk_shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass(frozen=True)
class TensorLoad:
    """How to fill one output tensor of shape ``out_shape``."""

    name: str
    out_shape: tuple[int, ...]
    reads: list[ChunkRead]


def wanted_box(saved: SavedTensor, num_ranks: int, new_rank: int, new_world_size: int) -> Box:
    """The box of a saved tensor that ``new_rank`` of ``new_world_size`` loads.

    Same world size: exactly the saved slice (even for uneven custom sizes).
    Another world size: :func:`~shardkit.layout.compute_shard_sizes` along the
    same dimension. Replicated tensors: the whole tensor.
    """
    spec = saved.spec
    if spec.shard_dim is None:
        return whole_box(spec.full_shape)
    sizes = spec.shard_sizes if new_world_size == num_ranks else \
        compute_shard_sizes(spec.full_shape[spec.shard_dim], new_world_size)
    return shard_box(spec.full_shape, spec.shard_dim, sizes, new_rank)


def saved_chunks(saved: SavedTensor) -> list[tuple[str, Box]]:
    """Every saved chunk of a tensor: (file name, box in the full tensor); version 1 and seed
    layouts are upgraded to chunks here, so one planner serves every version. Linear in the number
    of ranks."""
    if saved.chunks is not None:
        return [(c.file, c.box) for c in saved.chunks]
    spec = saved.spec
    if spec.shard_dim is None:
        return [(data_file_name(saved.owner_rank), whole_box(spec.full_shape))]
    offsets = shard_offsets(spec.shard_sizes)
    return [_rank_chunk(saved, rank, offsets[rank]) for rank in range(len(spec.shard_sizes))]


def _rank_chunk(saved: SavedTensor, rank: int, offset: int) -> tuple[str, Box]:
    spec = saved.spec
    offsets = [0] * len(spec.full_shape)
    sizes = list(spec.full_shape)
    offsets[spec.shard_dim], sizes[spec.shard_dim] = offset, spec.shard_sizes[rank]
    return data_file_name(rank), Box(tuple(offsets), tuple(sizes))


def chunks_by_file(tensors: Mapping[str, SavedTensor], files: Container[str] | None = None
                   ) -> dict[str, list[tuple[str, Box]]]:
    """``file -> [(tensor name, chunk box)]`` for every saved chunk (in ``files`` only, when given).

    Linear in the metadata's size.
    """
    by_file: dict[str, list[tuple[str, Box]]] = {}
    for name, saved in tensors.items():
        spec = saved.spec
        if spec.shard_dim is None:
            chunks = saved_chunks(saved)
        else:
            offsets = shard_offsets(spec.shard_sizes)
            chunks = [_rank_chunk(saved, r, offsets[r]) for r in range(len(spec.shard_sizes))
                      if files is None or data_file_name(r) in files]
        for file, box in chunks:
            if files is None or file in files:
                by_file.setdefault(file, []).append((name, box))
    return by_file


def overlapping_saved_chunks(saved: SavedTensor, box: Box) -> list[tuple[str, Box, Box]]:
    """``(file, chunk box, overlap)`` for every saved chunk of a tensor that shares an element with ``box``.

    Sharded tensors: the ranks whose slices meet the box along the shard
    dimension are found by bisection, so a load touches only those ranks.
    """
    spec = saved.spec
    if spec.shard_dim is None:
        chunks = saved_chunks(saved)
    else:
        offsets = list(itertools.accumulate(spec.shard_sizes, initial=0))
        lo = box.offsets[spec.shard_dim]
        hi = lo + box.sizes[spec.shard_dim]
        first = max(0, bisect.bisect_right(offsets, lo) - 1)
        last = min(len(spec.shard_sizes), bisect.bisect_left(offsets, hi))
        chunks = [_rank_chunk(saved, r, offsets[r]) for r in range(first, last) if spec.shard_sizes[r]]
    return [(chunks[i][0], chunks[i][1], overlap) for i, overlap in overlapping_chunks([b for _, b in chunks], box)]


def nonempty_chunk_files(saved: SavedTensor) -> Iterator[str]:
    """The files holding a non-empty chunk of the tensor, in rank order (lazily)."""
    spec = saved.spec
    if spec.shard_dim is None:
        yield data_file_name(saved.owner_rank)
        return
    for rank, size in enumerate(spec.shard_sizes):
        if size:
            yield data_file_name(rank)


def plan_load(tensors: Mapping[str, SavedTensor], want: Mapping[str, Box],
              max_scratch_elems_of: Callable[[str], int]) -> list[TensorLoad]:
    """For each ``name -> box`` in ``want``, the reads from every overlapping saved chunk.

    It trusts the chunk shapes: check them against the files first
    (``execute.check_chunks``), so a claimed shape no file holds never drives planning.
    """
    plans = []
    for name, box in want.items():
        reads = []
        for file, chunk, overlap in overlapping_saved_chunks(tensors[name], box):
            pieces = plan_box_reads(
                chunk.sizes, _minus(overlap.offsets, chunk.offsets),
                box.sizes, _minus(overlap.offsets, box.offsets),
                overlap.sizes, max_scratch_elems_of(name))
            reads.append(ChunkRead(file, chunk.sizes, pieces))
        plans.append(TensorLoad(name, box.sizes, reads))
    return plans


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b))

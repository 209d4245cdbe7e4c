"""Save and load plans, as plain data (habit 1: plan first, then do I/O).

- :func:`spec_chunk_plan` decides what each rank of a ``shard_spec`` save
  (``save_distributed``, the offline writers) writes, as the chunked plan
  (format 2) every save writes: its box of every sharded tensor, and the
  replicated tensors it is given, spread greedily by bytes, so replicated
  state is written once and in parallel. Every rank computes the same plan
  from the same names, shapes and specs.
- :func:`plan_load` decides, for each wanted tensor box, which saved chunks
  (file, box) overlap it and the exact element reads (:class:`~shardkit.layout.Piece`).

Sizes come in as plain ints and dtype widths through a callable, so these
functions are tested without tensors or a disk (habit 2).

Example::

    plan = spec_chunk_plan({"w": ((16,), "F32"), "b": ((2,), "F32")}, {"w": spec}, 2, {"F32": 4}.get)
    loads = plan_load(saved, {"w": Box((0,), (8,))}, lambda name: 1 << 20)
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Container, Iterator, Mapping

from shardkit.checkpoint.planning.chunk_plan import ChunkedTensor, ChunkPlan
from shardkit.checkpoint.format.compact_manifest import GridChunks
from shardkit.checkpoint.format.manifest import SavedTensor, data_file_name
from shardkit.checkpoint.format.spec import TensorShardSpec
from shardkit.checkpoint.planning.writer_choice import spread_by_bytes
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

__all__ = ["spec_chunk_plan", "split_spec", "chunk_split_dim", "ChunkRead", "TensorLoad", "wanted_box", "plan_load", "saved_chunks",
           "chunks_by_file", "overlapping_saved_chunks", "nonempty_chunk_files"]


def spec_chunk_plan(tensors: Mapping[str, tuple[tuple[int, ...], str]], specs: Mapping[str, TensorShardSpec],
                    world_size: int, itemsize_of: Callable[[str], int]) -> ChunkPlan:
    """The chunked (format 2) save plan of a ``shard_spec`` layout, the same on every rank.

    ``tensors``: name -> (full shape, safetensors dtype name); ``specs``: the
    sharded ones (a name absent, or with ``shard_dim`` None, is replicated).
    Rank r writes its own box of each sharded tensor (``shard_box``; empty
    boxes are not chunks); each replicated tensor is written whole, once, the
    writers spread by bytes (``writer_choice.spread_by_bytes``). Pure: no
    tensors, no I/O; it checks no shapes (``spec.check_local_tensor`` does).

    >>> plan = spec_chunk_plan({"w": ((4, 2), "F32")}, {"w": TensorShardSpec((4, 2), 0, (3, 1))}, 2, {"F32": 4}.get)
    >>> plan.writes
    [['w'], ['w']]
    """
    replicated = {n: _numel(shape) * itemsize_of(dtype) for n, (shape, dtype) in tensors.items()
                  if n not in specs or specs[n].shard_dim is None}
    writer_of = spread_by_bytes(replicated, world_size)
    plan = ChunkPlan({}, [[] for _ in range(world_size)])
    for name, (shape, dtype) in tensors.items():
        if name in replicated:
            chosen = {whole_box(shape): writer_of[name]} if name in writer_of else {}
        else:
            spec = specs[name]
            boxes = [(shard_box(shape, spec.shard_dim, spec.shard_sizes, r), r) for r in range(world_size)]
            chosen = {box: r for box, r in boxes if _numel(box.sizes)}
        plan.tensors[name] = ChunkedTensor(tuple(shape), dtype, chosen)
        for rank in chosen.values():
            plan.writes[rank].append(name)
    return plan


def _numel(shape) -> int:
    return math.prod(shape)


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
    same dimension. Replicated tensors: the whole tensor. A version-2 tensor
    is split as :func:`split_spec` reads its chunks.
    """
    spec = saved.spec if saved.chunks is None else (split_spec(saved, num_ranks) or saved.spec)
    if spec.shard_dim is None:
        return whole_box(spec.full_shape)
    sizes = spec.shard_sizes if new_world_size == num_ranks else \
        compute_shard_sizes(spec.full_shape[spec.shard_dim], new_world_size)
    return shard_box(spec.full_shape, spec.shard_dim, sizes, new_rank)


def split_spec(saved: SavedTensor, num_ranks: int) -> TensorShardSpec | None:
    """The ``shard_spec`` a version-2 tensor was saved with: None unless it records one (``split_dim``,
    written by ``save_distributed`` and the offline writers for sharded tensors).

    Chunks whose files' ranks increase with their offsets along that dimension (what those writers
    write) give rank r the size of its chunk in ``rank_<r>.safetensors`` (0 for a rank with none);
    others an even split (``compute_shard_sizes``). Linear in the chunks.

    >>> split_spec(read_metadata("ck").tensors["w"], 3)
    TensorShardSpec(full_shape=(8, 4), shard_dim=0, shard_sizes=(3, 3, 2))
    """
    dim, full = saved.split_dim, saved.spec.full_shape
    if dim is None or saved.chunks is None:
        return None
    if saved.split_sizes is not None:      # a tensor without an element: no chunk tells its sizes
        return TensorShardSpec(full, dim, saved.split_sizes)
    ordered = sorted(saved.chunks, key=lambda c: c.box.offsets[dim])
    ranks = [_file_rank(c.file) for c in ordered]
    single = all(c.box.sizes[d] == full[d] for c in ordered for d in range(len(full)) if d != dim)
    if single and all(a < b for a, b in zip(ranks, ranks[1:])) and (not ranks or ranks[-1] < num_ranks):
        sizes = [0] * num_ranks
        for rank, chunk in zip(ranks, ordered):
            sizes[rank] = chunk.box.sizes[dim]
        if sum(sizes) == full[dim]:
            return TensorShardSpec(full, dim, tuple(sizes))
    return TensorShardSpec(full, dim, tuple(compute_shard_sizes(full[dim], num_ranks)))


def chunk_split_dim(saved: SavedTensor) -> int | None:
    """The one dimension a version-2 tensor is split along: its recorded ``split_dim``, else the one
    its chunks split (None: one chunk, or chunks along several dimensions)."""
    if saved.split_dim is not None:
        return saved.split_dim
    if not saved.chunks or len(saved.chunks) < 2:
        return None
    full = saved.spec.full_shape
    dims = {d for c in saved.chunks for d, (size, whole) in enumerate(zip(c.box.sizes, full)) if size != whole}
    return dims.pop() if len(dims) == 1 else None


def _file_rank(file: str) -> int:
    file = file.rsplit("/", 1)[-1]   # a base's file (version 3) is keyed "<dir>/rank_<r>.safetensors"
    return int(file[len("rank_"):-len(".safetensors")])   # manifest.parse_manifest checked the name


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
    dimension are found by bisection, so a load touches only those ranks;
    a version-3 grid entry finds its cells the same way, per dimension,
    without expanding its chunks.
    """
    if isinstance(saved.chunks, GridChunks):
        return saved.chunks.overlapping(box)
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

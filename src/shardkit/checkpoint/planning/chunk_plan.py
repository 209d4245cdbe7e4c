"""Who writes which box: the chunked save plan, from every rank's boxes, as plain data.

Each rank reports, for every tensor of its state, the global shape, the dtype
and the box of the global tensor it holds (a DTensor's local shard, or the
whole tensor for a plain one). :func:`plan_chunks` checks that the ranks
agree (same names, shapes, dtypes) and that the distinct boxes cover each
tensor exactly, then gives every distinct non-empty box **one** writer among
the ranks holding it, spreading bytes across ranks greedily (largest box
first, to the holder with the fewest bytes so far). Every rank computes the
same plan from the same reports. No torch, no I/O (habit 2).

Example::

    reports = [{"w": ((4, 2), "F32", (0, 0), (2, 2))}, {"w": ((4, 2), "F32", (2, 0), (2, 2))}]
    plan = plan_chunks(reports, itemsize_of={"F32": 4}.__getitem__)
    plan.writes[1]          # ["w"]: rank 1 writes its box of w
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from shardkit.checkpoint.format.chunks import Chunk, check_cover
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import Box

__all__ = ["BoxReport", "ChunkedTensor", "ChunkPlan", "plan_chunks", "check_tiling"]

#: (global shape, dtype name, offsets, sizes) of the box one rank holds of one tensor.
BoxReport = tuple[tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ChunkedTensor:
    full_shape: tuple[int, ...]
    dtype: str
    box_to_writer: dict[Box, int]       # every distinct non-empty box, and the rank that writes it


@dataclass
class ChunkPlan:
    tensors: dict[str, ChunkedTensor]
    writes: list[list[str]] = field(default_factory=list)   # rank -> the tensor names it writes (its own box)


def plan_chunks(reports: Sequence[dict[str, BoxReport]], itemsize_of: Callable[[str], int]) -> ChunkPlan:
    """The chunked save plan of ``len(reports)`` ranks; raises :class:`TensorMismatchError` when they disagree."""
    names = _agreed_names(reports)
    holders: dict[str, dict[Box, list[int]]] = {}
    tensors = {}
    for name in names:
        shape, dtype = _agreed_shape(reports, name)
        boxes: dict[Box, list[int]] = {}
        for rank, report in enumerate(reports):
            box = Box(tuple(report[name][2]), tuple(report[name][3]))
            if math.prod(box.sizes):
                boxes.setdefault(box, []).append(rank)
        check_tiling(name, shape, boxes)
        holders[name] = boxes
        tensors[name] = (shape, dtype)
    box_to_writer = _spread(holders, {n: itemsize_of(d) for n, (_, d) in tensors.items()}, len(reports))
    plan = ChunkPlan({n: ChunkedTensor(s, d, box_to_writer[n]) for n, (s, d) in tensors.items()},
                     [[] for _ in reports])
    for name, chosen in box_to_writer.items():
        for box, rank in chosen.items():
            plan.writes[rank].append(name)
    return plan


def _agreed_names(reports) -> list[str]:
    first = set(reports[0])
    for rank, report in enumerate(reports):
        if set(report) != first:
            extra = sorted(set(report) ^ first)[:5]
            raise TensorMismatchError(
                f"ranks 0 and {rank} pass states with different tensors (differing: {', '.join(extra)}); every rank "
                f"must pass the same structure (the same names, as get_state_dict gives them)")
    return sorted(first)


def _agreed_shape(reports, name: str) -> tuple[tuple[int, ...], str]:
    shape, dtype = tuple(reports[0][name][0]), reports[0][name][1]
    for rank, report in enumerate(reports):
        if (tuple(report[name][0]), report[name][1]) != (shape, dtype):
            raise TensorMismatchError(
                f"tensor {name!r} is {list(report[name][0])} {report[name][1]} on rank {rank} but {list(shape)} "
                f"{dtype} on rank 0; a plain tensor must be the same on every rank (replicated), a DTensor must "
                f"have the same global shape and dtype everywhere")
    return shape, dtype


def check_tiling(name: str, shape, boxes) -> None:
    """Raise :class:`TensorMismatchError` unless the distinct ``boxes`` (keys) tile tensor ``name`` exactly."""
    chunks = [Chunk(f"box{i}", b.offsets, b.sizes, 0, 0) for i, b in enumerate(boxes)]
    try:
        check_cover(name, shape, chunks, source="the ranks' states")
    except MetadataError as e:
        raise TensorMismatchError(
            f"{e}. The ranks' shards of {name!r} do not tile the tensor: boxes held "
            f"{[(list(b.offsets), list(b.sizes)) for b in boxes][:6]}; is every rank of the mesh saving?") from e


def _spread(holders: dict[str, dict[Box, list[int]]], itemsize: dict[str, int], world_size: int):
    load = [0] * world_size
    chosen: dict[str, dict[Box, int]] = {n: {} for n in holders}
    items = [(b.numel * itemsize[n], n, b) for n, boxes in holders.items() for b in boxes]
    for nbytes, name, box in sorted(items, key=lambda x: (-x[0], x[1], x[2].offsets)):
        rank = min(holders[name][box], key=lambda r: (load[r], r))
        chosen[name][box] = rank
        load[rank] += nbytes
    return chosen

"""Pure shard arithmetic: sizes, offsets, boxes, overlaps and read plans.

Everything here works on plain ``int`` tuples in C (row-major) order: no
torch, no files. ``shardkit.checkpoint`` uses it to decide which saved
chunks overlap the box a rank wants, and how to read each overlap with few,
large reads and a bounded scratch buffer.

A *box* is ``(offsets, sizes)``, one entry per dimension, describing the
elements ``offsets[d] <= i_d < offsets[d] + sizes[d]``.

Example::

    >>> compute_shard_sizes(10, 4)
    [3, 3, 2, 2]
    >>> shard_box((10, 6), 0, [3, 3, 2, 2], 1)
    Box(offsets=(3, 0), sizes=(3, 6))
    >>> intersect(Box((0, 0), (4, 6)), Box((3, 0), (3, 6)))
    Box(offsets=(3, 0), sizes=(1, 6))
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = [
    "bounded_numel",
    "Box",
    "Piece",
    "compute_shard_sizes",
    "shard_offsets",
    "shard_box",
    "whole_box",
    "intersect",
    "overlapping_chunks",
    "cover_problem",
    "c_strides",
    "linear_index",
    "is_contiguous_box",
    "plan_box_reads",
]


class Box(NamedTuple):
    """A rectangular region: per-dimension start offsets and sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


_INT64_MAX = 2**63 - 1


def bounded_numel(shape: Sequence[int], limit: int) -> int | None:
    """The element count of ``shape``, or None when it exceeds ``limit`` (never builds a huge product).

    Claimed shapes come from untrusted files: this stops multiplying as soon
    as the product passes ``limit``. A zero dimension anywhere gives 0, unless
    the other dimensions' product passes int64, which torch cannot lay out
    (None then, too).

    >>> bounded_numel((2**20, 2**20, 0), 10), bounded_numel((2**50, 2), 10), bounded_numel((2**62, 2**62, 0), 10)
    (0, None, None)
    """
    if any(d == 0 for d in shape):
        return 0 if bounded_numel([d for d in shape if d], _INT64_MAX) is not None else None
    numel = 1
    for d in shape:
        numel *= d
        if numel > limit:
            return None
    return numel


def compute_shard_sizes(total: int, num_parts: int) -> list[int]:
    """Split ``total`` into ``num_parts`` sizes; the first ``total % num_parts`` get one more.

    Does not accept ``num_parts < 1`` or negative totals (``ValueError``).

    >>> compute_shard_sizes(7, 3)
    [3, 2, 2]
    """
    if not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts must be an integer >= 1, got {num_parts!r}")
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total!r}")
    base, extra = divmod(total, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def shard_offsets(shard_sizes: Sequence[int]) -> list[int]:
    """Start offset of each shard: the running sum of the sizes before it."""
    offsets, position = [], 0
    for size in shard_sizes:
        offsets.append(position)
        position += size
    return offsets


def whole_box(shape: Sequence[int]) -> Box:
    """The box covering every element of ``shape``."""
    return Box(tuple(0 for _ in shape), tuple(shape))


def shard_box(full_shape: Sequence[int], shard_dim: int | None, shard_sizes: Sequence[int], rank: int) -> Box:
    """The box of the full tensor that ``rank`` holds (the whole tensor when ``shard_dim`` is None)."""
    if shard_dim is None:
        return whole_box(full_shape)
    offsets = [0] * len(full_shape)
    sizes = list(full_shape)
    offsets[shard_dim] = shard_offsets(shard_sizes)[rank]
    sizes[shard_dim] = shard_sizes[rank]
    return Box(tuple(offsets), tuple(sizes))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when it holds no element."""
    offsets, sizes = [], []
    for a_off, a_size, b_off, b_size in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def overlapping_chunks(chunk_boxes: Sequence[Box], want: Box) -> list[tuple[int, Box]]:
    """``(chunk_index, overlap)`` for every chunk that shares at least one element with ``want``."""
    found = []
    for index, chunk in enumerate(chunk_boxes):
        overlap = intersect(chunk, want)
        if overlap is not None:
            found.append((index, overlap))
    return found


#: ``cover_problem`` checks a grid of at most this many cells per box (plus 1024) unless told otherwise.
GRID_CELLS_PER_BOX = 16


def cover_problem(full_shape: Sequence[int], boxes: Sequence[Box], max_cells: int | None = None) -> str | None:
    """What is wrong with ``boxes`` as an exact cover of ``full_shape`` (no gap, no overlap), or None.

    Each box must have one offset and one size per dimension, none negative,
    and lie inside the shape. Linear in the boxes: their offsets cut each
    dimension, the cuts form a grid, and each box marks the grid cells it
    spans; a cell marked twice is an overlap, and with no overlap equal
    volumes mean no gap. A grid of more than ``max_cells`` cells (default:
    ``GRID_CELLS_PER_BOX`` per box, plus 1024; far more cells than boxes
    means a hand-made layout) is refused rather than checked at
    a cost the caller's file merely claims. Empty boxes are allowed anywhere
    inside the shape. It says what it found; it raises nothing.

    >>> cover_problem((4,), [Box((0,), (2,)), Box((2,), (2,))]) is None
    True
    >>> cover_problem((4,), [Box((0,), (2,)), Box((1,), (2,))])
    'overlapping boxes (one at offsets [1])'
    """
    rank = len(full_shape)
    for b in boxes:
        if len(b.offsets) != rank or len(b.sizes) != rank:
            return f"a box at offsets {list(b.offsets)} sizes {list(b.sizes)} does not have {rank} dimensions"
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(b.offsets, b.sizes, full_shape)):
            return f"a box at offsets {list(b.offsets)} sizes {list(b.sizes)} leaves the shape {list(full_shape)}"
    nonempty = [b for b in boxes if math.prod(b.sizes)]
    covered = sum(math.prod(b.sizes) for b in nonempty)
    if covered != math.prod(full_shape):
        return f"the boxes hold {covered} elements, the shape {list(full_shape)} has {math.prod(full_shape)}"
    if len(nonempty) <= 1:  # one box inside the shape, as large as it: the shape itself
        return None
    cuts = [sorted({0, n, *(b.offsets[d] for b in nonempty), *(b.offsets[d] + b.sizes[d] for b in nonempty)})
            for d, n in enumerate(full_shape)]
    cells = math.prod(len(dim_cuts) - 1 for dim_cuts in cuts)
    if cells > (GRID_CELLS_PER_BOX * len(boxes) + 1024 if max_cells is None else max_cells):
        return f"the {len(nonempty)} boxes do not form a grid (their cuts make {cells} cells)"
    marked: set[tuple[int, ...]] = set()
    for b in nonempty:
        spans = [range(bisect.bisect_left(dim_cuts, o), bisect.bisect_left(dim_cuts, o + s))
                 for dim_cuts, o, s in zip(cuts, b.offsets, b.sizes)]
        for cell in itertools.product(*spans):
            if cell in marked:
                return f"overlapping boxes (one at offsets {list(b.offsets)})"
            marked.add(cell)
    return None


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def linear_index(shape: Sequence[int], index: Sequence[int]) -> int:
    """Element offset of ``index`` in a C-contiguous array of ``shape``."""
    return sum(i * s for i, s in zip(index, c_strides(shape)))


def is_contiguous_box(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """True when the box is one contiguous run of elements of a C-contiguous ``shape``.

    That holds when every dimension after the last partial one is full and
    every dimension before it has size 1 (an empty box is trivially contiguous).
    """
    if math.prod(sizes) == 0:
        return True
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return True
    return all(sizes[d] == 1 for d in range(partial[-1]))


@dataclass(frozen=True)
class Piece:
    """One read: ``src_numel`` elements from ``src_start`` of the chunk, then a strided copy.

    The elements read, viewed with ``sizes`` / ``src_strides`` (storage offset
    0), go to the destination viewed with ``sizes`` / ``dst_strides`` at
    ``dst_start``. ``direct`` pieces are contiguous on both sides and can be
    read straight into the destination, without scratch memory.
    """

    src_start: int
    src_numel: int
    sizes: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_start: int
    dst_strides: tuple[int, ...]
    direct: bool


def plan_box_reads(
    src_shape: Sequence[int],
    src_offsets: Sequence[int],
    dst_shape: Sequence[int],
    dst_offsets: Sequence[int],
    sizes: Sequence[int],
    max_scratch_elems: int,
) -> list[Piece]:
    """Plan the reads that copy a box of a saved chunk into a box of an output array.

    Both arrays are C-contiguous. A box contiguous on both sides becomes one
    direct piece. Otherwise rows (along the first dimension) are batched so
    that each piece reads one contiguous span of at most
    ``max_scratch_elems`` elements (the span from the first to the last
    wanted element of those rows); a single row larger than that is split
    along the next dimension. It performs no I/O.

    >>> [p.direct for p in plan_box_reads((4, 6), (0, 2), (4, 3), (0, 0), (4, 3), 100)]
    [False]
    """
    if max_scratch_elems < 1:
        raise ValueError(f"max_scratch_elems must be >= 1, got {max_scratch_elems}")
    pieces: list[Piece] = []
    if math.prod(sizes) > 0:
        _plan(tuple(src_shape), tuple(src_offsets), 0, tuple(dst_shape), tuple(dst_offsets), 0,
              tuple(sizes), max_scratch_elems, pieces)
    return pieces


def _plan(src_shape, src_off, src_base, dst_shape, dst_off, dst_base, sizes, max_elems, out) -> None:
    src_first = src_base + linear_index(src_shape, src_off)
    dst_first = dst_base + linear_index(dst_shape, dst_off)
    numel = math.prod(sizes)
    if is_contiguous_box(src_shape, src_off, sizes) and is_contiguous_box(dst_shape, dst_off, sizes):
        out.append(Piece(src_first, numel, (numel,), (1,), dst_first, (1,), True))
        return
    src_row, dst_row = c_strides(src_shape)[0], c_strides(dst_shape)[0]
    # Elements from the first to the last wanted one within a single row.
    span = linear_index(src_shape[1:], [o + s - 1 for o, s in zip(src_off[1:], sizes[1:])]) + 1 \
        - linear_index(src_shape[1:], src_off[1:])
    if span <= max_elems:
        _batch_rows(src_first, src_row, c_strides(src_shape[1:]), span, dst_first, dst_row,
                    c_strides(dst_shape[1:]), sizes, max_elems, out)
        return
    # One row is too big for the scratch buffer: plan each row on its own, one dimension down.
    for i in range(sizes[0]):
        _plan(src_shape[1:], src_off[1:], src_base + (src_off[0] + i) * src_row,
              dst_shape[1:], dst_off[1:], dst_base + (dst_off[0] + i) * dst_row,
              sizes[1:], max_elems, out)


def _batch_rows(src_first, src_row, src_inner, span, dst_first, dst_row, dst_inner, sizes, max_elems, out):
    # k rows read as one span need (k - 1) * src_row + span elements.
    rows_per_read = max(1, (max_elems - span) // src_row + 1) if src_row else sizes[0]
    for r0 in range(0, sizes[0], rows_per_read):
        k = min(rows_per_read, sizes[0] - r0)
        out.append(Piece(
            src_start=src_first + r0 * src_row,
            src_numel=(k - 1) * src_row + span,
            sizes=(k,) + tuple(sizes[1:]),
            src_strides=(src_row,) + src_inner,
            dst_start=dst_first + r0 * dst_row,
            dst_strides=(dst_row,) + dst_inner,
            direct=False,
        ))

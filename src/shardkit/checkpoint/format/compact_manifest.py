"""Compact tensor entries of ``metadata.json`` version 3: a regular layout as one grid, not one chunk per rank.

A tensor whose chunks form a **grid** (each dimension cut into parts by a
split, ``grid_split.py``; every non-empty cell of the product one chunk)
stored in this checkpoint's own ``rank_<r>.safetensors`` files is written
as ``{"grid": {"splits": [...], "files": ...}}``: O(dimensions) words for
an FSDP2 ``Shard(0)`` tensor on any number of ranks. ``files`` maps a cell
(its index per dimension, empty cells counted) to the rank whose file holds
it, either ``{"first": f, "steps": [s0, s1, ...]}`` (rank ``f + sum(i_d *
s_d)``) or ``{"ranks": [...]}`` (row-major over every cell, ``-1`` for an
empty cell). Any other tensor keeps the general chunk list
(``chunks.py``). Byte ranges are not stored: a data file orders its
tensors as ``storage.file_layout`` does, so they follow from the file's
header length and the chunks it holds (:func:`derived_ranges`); readers
check the header against the metadata before trusting bytes.

In memory a grid entry is a :class:`GridChunks`: a sequence of
:class:`~shardkit.checkpoint.format.chunks.Chunk` (``begin``/``end`` None: derived)
that answers :meth:`GridChunks.overlapping` without expanding every cell,
so readers treat both kinds through one interface (``plan.py``). This
module does no I/O and chooses no writers.

Example::

    g = Grid((8, 4), (ChunkSplit(8, (4,)), ChunkSplit(4)), first=0, steps=(1, 0))
    grid_to_json(g)       # {"splits": [{"chunk": [4]}, None], "files": {"first": 0, "steps": [1, 0]}}
    GridChunks(g).overlapping(Box((1, 0), (2, 4)))   # [("rank_0.safetensors", Box(...)), ("rank_1...", ...)]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import MISSING, dataclass, fields
from functools import cached_property
from typing import Any, Iterator, Sequence

import numpy as np

from shardkit import knobs
from shardkit.checkpoint.format.chunks import Chunk, chunks_to_json
from shardkit.checkpoint.format.grid_split import Split, parse_split, split_of_sizes
from shardkit.errors import MetadataError
from shardkit.layout import Box, intersect
from shardkit.storage import file_layout
from shardkit.storage.json_io import expect_dict, expect_int, expect_list, short_repr

__all__ = ["Grid", "GridChunks", "grid_to_json", "layout_json", "check_grid_cells", "parse_grid", "grid_of_chunks", "affine_or_ranks",
           "derived_ranges", "file_name", "file_rank"]

_CHUNK_FIELDS = {"file", "offsets", "sizes", "begin", "end"}


def file_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def file_rank(name: str) -> int | None:
    """``r`` for ``rank_<r>.safetensors`` (this checkpoint's own data file), else None."""
    digits = name[len("rank_"):-len(".safetensors")] if name.startswith("rank_") else ""
    return int(digits) if digits.isdigit() and digits.isascii() and name == file_name(int(digits)) else None


@dataclass(frozen=True)
class Grid:
    """A tensor stored as a grid of chunks; ``files`` by ``first`` + ``steps`` or by ``ranks`` (row-major)."""

    full_shape: tuple[int, ...]
    splits: tuple[Split, ...]
    first: int = 0
    steps: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(s.count for s in self.splits)

    def rank_of(self, cell: Sequence[int]) -> int:
        if self.ranks is not None:
            index = 0
            for i, k in zip(cell, self.counts):
                index = index * k + i
            return self.ranks[index]
        return self.first + sum(i * s for i, s in zip(cell, self.steps))

    def box(self, cell: Sequence[int]) -> Box:
        return Box(tuple(s.offset(i) for s, i in zip(self.splits, cell)),
                   tuple(s.size(i) for s, i in zip(self.splits, cell)))

    def cells(self) -> Iterator[tuple[int, ...]]:
        """Every non-empty cell, row-major."""
        if not math.prod(self.full_shape):
            return iter(())
        return itertools.product(*(s.overlapping(0, n) for s, n in zip(self.splits, self.full_shape)))

    def bytes_per_rank(self, itemsize: int, num_ranks: int) -> np.ndarray:
        """The bytes each rank's file holds of this tensor (vectorized: O(cells) in numpy, not Python)."""
        out = np.zeros(num_ranks, dtype=np.int64)
        if not math.prod(self.full_shape):
            return out
        cell_bytes = np.ones((), dtype=np.int64) * itemsize
        for s in self.splits:
            cell_bytes = np.multiply.outer(cell_bytes, s.sizes_array())
        cell_bytes, ranks = cell_bytes.reshape(-1), self._rank_array().reshape(-1)
        np.add.at(out, ranks[cell_bytes > 0], cell_bytes[cell_bytes > 0])
        return out

    def _rank_array(self) -> np.ndarray:
        if self.ranks is not None:
            return np.maximum(np.array(self.ranks, dtype=np.int64), 0).reshape(self.counts)
        ranks = np.full((), self.first, dtype=np.int64)
        for k, s in zip(self.counts, self.steps):
            ranks = np.add.outer(ranks, np.arange(k, dtype=np.int64) * s)
        return ranks


class GridChunks(Sequence):
    """The chunks of a :class:`Grid`, as a sequence of :class:`Chunk` (byte ranges None: derived).

    Iterating or indexing expands every cell (O(chunks), cached); :meth:`overlapping` and ``len``
    do not.
    """

    def __init__(self, grid: Grid):
        self.grid = grid

    def overlapping(self, want: Box) -> list[tuple[str, Box, Box]]:
        """``(file, chunk box, overlap)`` of every chunk that shares an element with ``want``."""
        g = self.grid
        per_dim = [s.overlapping(o, o + n) for s, o, n in zip(g.splits, want.offsets, want.sizes)]
        out = []
        for cell in itertools.product(*per_dim):
            box = g.box(cell)
            overlap = intersect(box, want)
            if overlap is not None:
                out.append((file_name(g.rank_of(cell)), box, overlap))
        return out

    @cached_property
    def _chunks(self) -> tuple[Chunk, ...]:
        g = self.grid
        return tuple(Chunk(file_name(g.rank_of(c)), *g.box(c), None, None) for c in g.cells())

    def __len__(self) -> int:
        if not math.prod(self.grid.full_shape):
            return 0
        return math.prod(len(s.overlapping(0, n)) for s, n in zip(self.grid.splits, self.grid.full_shape))

    def __getitem__(self, i):
        return self._chunks[i]

    def __iter__(self):
        return iter(self._chunks)

    def __eq__(self, other) -> bool:
        return isinstance(other, GridChunks) and other.grid == self.grid

    def __hash__(self) -> int:
        return hash(self.grid)

    def __repr__(self) -> str:
        return f"GridChunks({self.grid!r})"


def grid_to_json(g: Grid) -> dict:
    files = {"ranks": list(g.ranks)} if g.ranks is not None else {"first": g.first, "steps": list(g.steps)}
    return {"splits": [s.to_json() for s in g.splits], "files": files}


def parse_grid(source: str, name: str, raw: Any, full_shape: tuple[int, ...], num_ranks: int) -> GridChunks:
    """A grid entry from its JSON, checked (``MetadataError`` otherwise): a split per dimension, at most
    ``num_ranks`` cells in all, every cell's file a rank below ``num_ranks``, no two non-empty cells in
    one file. O(dimensions), or O(cells) for an explicit ``ranks`` list; nothing is expanded."""
    what = f"{source}: tensor {short_repr(name)} grid"
    raw = expect_dict(raw, what)
    raw_splits = expect_list(raw.get("splits"), f"{what}: splits", max_items=len(full_shape))
    if len(raw_splits) != len(full_shape):
        raise MetadataError(f"{what} has {len(raw_splits)} splits, expected {len(full_shape)} (one per dimension)")
    splits, cells = [], 1
    for d, (r, n) in enumerate(zip(raw_splits, full_shape)):
        split = parse_split(r, n, max(1, num_ranks // cells), f"{what}: splits[{d}]")
        cells *= split.count
        splits.append(split)
    files = expect_dict(raw.get("files"), f"{what}: files")
    if "ranks" in files:
        ranks = expect_list(files["ranks"], f"{what}: files.ranks", max_items=cells)
        g = Grid(full_shape, tuple(splits),
                 ranks=tuple(expect_int(r, f"{what}: files.ranks", low=-1, high=num_ranks - 1) for r in ranks))
        _check_ranks(what, g, cells)
    else:
        first = expect_int(files.get("first"), f"{what}: files.first", high=num_ranks - 1)
        steps = expect_list(files.get("steps"), f"{what}: files.steps", max_items=len(full_shape))
        g = Grid(full_shape, tuple(splits), first,
                 tuple(expect_int(s, f"{what}: files.steps", low=-num_ranks, high=num_ranks) for s in steps))
        _check_affine(what, g, num_ranks)
    return GridChunks(g)


def _check_ranks(what: str, g: Grid, cells: int) -> None:
    if len(g.ranks) != cells:
        raise MetadataError(f"{what}: files.ranks has {len(g.ranks)} entries, expected {cells} (one per cell)")
    nonempty = set(g.cells())
    seen = set()
    for index, (cell, r) in enumerate(zip(itertools.product(*(range(k) for k in g.counts)), g.ranks)):
        if (r >= 0) != (cell in nonempty) or r in seen:
            raise MetadataError(f"{what}: files.ranks[{index}] is {r}; an empty cell has -1, a non-empty "
                                f"one a rank whose file holds no other cell of the tensor")
        if r >= 0:
            seen.add(r)


def _check_affine(what: str, g: Grid, num_ranks: int) -> None:
    if len(g.steps) != len(g.full_shape):
        raise MetadataError(f"{what}: files.steps has {len(g.steps)} entries, expected {len(g.full_shape)}")
    spans = [(k - 1) * s for k, s in zip(g.counts, g.steps)]
    low = g.first + sum(min(0, x) for x in spans)
    high = g.first + sum(max(0, x) for x in spans)
    if low < 0 or high >= num_ranks:
        raise MetadataError(f"{what} places cells in ranks {low}..{high}; the checkpoint has ranks 0..{num_ranks - 1}")
    reach = 0   # distinct cells get distinct files: each step passes everything the smaller ones reach
    for k, s in sorted(((k, abs(s)) for k, s in zip(g.counts, g.steps) if k > 1), key=lambda ks: ks[1]):
        if s <= reach:
            raise MetadataError(f"{what}: files.steps {list(g.steps)} put two cells in one file")
        reach += s * (k - 1)


def affine_or_ranks(full_shape: tuple[int, ...], splits: tuple[Split, ...], ranks: np.ndarray,
                    num_ranks: int) -> Grid:
    """The grid of ``splits`` whose cell ``i`` is in rank ``ranks[i]`` (an array of the grid's counts,
    -1 or anything for an empty cell): by ``first`` + ``steps`` when that fits (and passes the
    checks ``parse_grid`` makes), else listed."""
    counts = tuple(s.count for s in splits)
    ranks = ranks.reshape(counts)
    nonempty = np.ones((), dtype=bool)
    for s in splits:
        nonempty = np.logical_and.outer(nonempty, s.sizes_array() > 0)
    first = int(ranks[(0,) * len(counts)]) if ranks.size else 0
    steps = tuple(int(ranks[tuple(1 if e == d else 0 for e in range(len(counts)))]) - first if k > 1 else 0
                  for d, k in enumerate(counts))
    grid = Grid(full_shape, splits, first, steps)
    try:
        _check_affine("the planned grid", grid, num_ranks)
    except MetadataError:
        pass
    else:
        if np.array_equal(np.where(nonempty, grid._rank_array(), -1), np.where(nonempty, ranks, -1)):
            return grid
    return Grid(full_shape, splits, ranks=tuple(np.where(nonempty, ranks, -1).reshape(-1).tolist()))


def grid_of_chunks(full_shape: tuple[int, ...], chunks: Sequence[Chunk]) -> Grid | None:
    """The grid that stores exactly ``chunks`` (a checked cover of ``full_shape``), or None when they are
    not a grid, or one lies outside this checkpoint's own rank files (a chunk with extra fields,
    e.g. a reference to another checkpoint, is never compacted). O(chunks)."""
    if not chunks or any(file_rank(c.file) is None for c in chunks):
        return None
    if not all(map(_plain_chunk, chunks)):
        return None
    per_dim = [sorted({(c.offsets[d], c.sizes[d]) for c in chunks}) for d in range(len(full_shape))]
    if math.prod(len(p) for p in per_dim) != len(chunks):
        return None
    splits, index = [], []
    for n, parts in zip(full_shape, per_dim):
        starts = [o for o, _ in parts]
        if starts != list(itertools.accumulate((s for _, s in parts[:-1]), initial=0)) or sum(s for _, s in parts) != n:
            return None
        splits.append(split_of_sizes(n, [s for _, s in parts]))
        index.append({o: i for i, o in enumerate(starts)})
    ranks = np.full([len(p) for p in per_dim], -1, dtype=np.int64)
    for c in chunks:
        ranks[tuple(ix[o] for ix, o in zip(index, c.offsets))] = file_rank(c.file)
    return affine_or_ranks(tuple(full_shape), tuple(splits), ranks, int(ranks.max()) + 1)


def _plain_chunk(c: Chunk) -> bool:
    """Whether ``c`` carries nothing beyond a box in a file (any field added to chunks, e.g. a reference
    to another checkpoint's data, left at its default or None)."""
    for f in fields(c):
        if f.name in _CHUNK_FIELDS:
            continue
        value = getattr(c, f.name)
        if value is not None and (f.default is MISSING or value != f.default):
            return False
    return True


def derived_ranges(held: Sequence[tuple[str, str, Sequence[int]]], data_start: int) -> dict[str, tuple[int, int]]:
    """``name -> (begin, end)`` in a data file holding ``held`` (name, dtype name, chunk shape) whose tensor
    data starts at byte ``data_start``: the order ``storage.file_layout`` writes (widest dtype, then name)."""
    layout = file_layout(list(held), None)
    base = len(layout.header)
    return {e.name: (data_start + e.begin - base, data_start + e.end - base) for e in layout.entries}


def layout_json(chunks, base_index: dict[str, int]) -> dict:
    """A version-3 tensor's layout: ``{"grid": ...}`` for a :class:`GridChunks`, else ``{"chunks": [...]}``
    (a chunk in a base's file names the base by its place in ``bases``: ``base_index``)."""
    if isinstance(chunks, GridChunks):
        return {"grid": grid_to_json(chunks.grid)}
    return {"chunks": chunks_to_json(chunks, base_index)}


def check_grid_cells(source: str, layouts, fix: str) -> None:
    """Refuse a metadata whose grid entries (among ``layouts``, each tensor's chunks) have more than
    ``knobs.MAX_GRID_CELLS`` cells in all: a hostile file must not make a reader walk billions of cells."""
    cells = sum(math.prod(c.grid.counts) for c in layouts if isinstance(c, GridChunks))
    if cells > knobs.MAX_GRID_CELLS:
        raise MetadataError(f"{source}'s grid entries have {cells:,} cells in all, more than "
                            f"knobs.MAX_GRID_CELLS ({knobs.MAX_GRID_CELLS:,}). {fix}")

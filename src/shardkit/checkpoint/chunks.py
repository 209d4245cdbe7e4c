"""Chunks: a saved tensor described as boxes of the global tensor, each in a file at a byte range.

Format version 2 (``docs/format.md``) describes every saved tensor by its
chunks instead of a one-dimensional split: a chunk is a box of the global
tensor (``offsets``, ``sizes``), the data file holding it (under the tensor's
own name) and the byte range of that file's entry. Any box layout (FSDP2,
HSDP, tensor parallel, 2-D meshes) therefore reshards to any other. The
chunks of a tensor cover it exactly: every element in exactly one chunk.
This module parses and checks chunk JSON and does no I/O; it never decides
who writes what (``chunk_plan.py``).

Example::

    c = Chunk("rank_0.safetensors", (0, 0), (4, 8), 96, 224)
    chunks_to_json([c])       # [{"offsets": [0, 0], "sizes": [4, 8], "file": ..., "byte_range": [96, 224]}]
    check_cover("w", (8, 8), [c, ...], source="metadata.json")
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.layout import Box
from shardkit.storage.json_io import short_repr

__all__ = ["Chunk", "chunks_to_json", "parse_chunks", "check_cover", "MAX_CHUNKS_PER_TENSOR"]

#: A hostile metadata.json cannot make the cover check quadratic in something huge.
MAX_CHUNKS_PER_TENSOR = 1 << 16

#: The cover check marks grid cells; a grid may have at most this many cells per
#: chunk (plus a constant) before the layout is refused as not one shardkit writes.
MAX_GRID_CELLS_PER_CHUNK = 16


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: where it lies in the global tensor and in which file's bytes."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    begin: int          # absolute byte offsets of the entry in ``file``
    end: int

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)


def chunks_to_json(chunks: Sequence[Chunk]) -> list[dict]:
    return [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "byte_range": [c.begin, c.end]}
            for c in chunks]


def _ints(source: str, what: str, raw: Any, length: int | None = None) -> tuple[int, ...]:
    if (not isinstance(raw, list) or len(raw) > knobs.MAX_TENSOR_NDIM
            or any(not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= knobs.MAX_TENSOR_DIM for v in raw)):
        raise MetadataError(f"{source}: {what} is {short_repr(raw)}, expected a list of at most "
                            f"{knobs.MAX_TENSOR_NDIM} integers in 0..{knobs.MAX_TENSOR_DIM}")
    if length is not None and len(raw) != length:
        raise MetadataError(f"{source}: {what} has {len(raw)} entries, expected {length} (one per dimension)")
    return tuple(raw)


def parse_chunks(source: str, name: str, raw: Any, full_shape: tuple[int, ...], itemsize: int,
                 check_file) -> tuple[Chunk, ...]:
    """The chunks of tensor ``name`` from their JSON, checked: in bounds, byte ranges of the right
    length, an exact cover of ``full_shape``. ``check_file(name) -> name`` refuses bad file names."""
    if not isinstance(raw, list) or len(raw) > MAX_CHUNKS_PER_TENSOR:
        raise MetadataError(f"{source}: tensor {short_repr(name)} has chunks {type(raw).__name__}; expected a list of at "
                            f"most {MAX_CHUNKS_PER_TENSOR} chunk objects")
    chunks = []
    for i, c in enumerate(raw):
        where = f"tensor {name!r} chunk {i}"
        if not isinstance(c, dict):
            raise MetadataError(f"{source}: {where} is not an object")
        offsets = _ints(source, f"{where} offsets", c.get("offsets"), len(full_shape))
        sizes = _ints(source, f"{where} sizes", c.get("sizes"), len(full_shape))
        begin, end = _ints(source, f"{where} byte_range", c.get("byte_range"), 2)
        if end - begin != math.prod(sizes) * itemsize:
            raise MetadataError(f"{source}: {where} has byte_range [{begin}, {end}) of {end - begin} bytes, but "
                                f"its sizes {list(sizes)} need {math.prod(sizes) * itemsize}")
        if not isinstance(c.get("file"), str):
            raise MetadataError(f"{source}: {where} has file {short_repr(c.get('file'))}, expected a file name")
        chunks.append(Chunk(check_file(c["file"]), offsets, sizes, begin, end))
    check_cover(name, full_shape, chunks, source=source)
    return tuple(chunks)


def check_cover(name: str, full_shape: tuple[int, ...], chunks: Sequence[Chunk], *, source: str) -> None:
    """Raise :class:`MetadataError` unless ``chunks`` cover ``full_shape`` exactly (no gap, no overlap).

    Linear in the chunks: their offsets cut each dimension, the cuts form a
    grid, and each chunk marks the grid cells it spans; a cell marked twice is
    an overlap, and with no overlap equal volumes mean no gap. Every layout
    shardkit writes is such a grid with one cell per chunk; a layout whose grid
    has far more cells than chunks (only a hand-made file has one) is refused
    rather than checked at a cost the file merely claims.
    """
    seen_files = set()
    for c in chunks:
        if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, full_shape)):
            raise MetadataError(f"{source}: tensor {name!r} has a chunk at offsets {list(c.offsets)} sizes "
                                f"{list(c.sizes)} that leaves its shape {list(full_shape)}")
        if c.file in seen_files:
            raise MetadataError(f"{source}: tensor {name!r} has two chunks in {c.file}; a file holds at most one "
                                f"chunk of a tensor (under the tensor's name)")
        seen_files.add(c.file)
    nonempty = [c for c in chunks if math.prod(c.sizes)]
    covered = sum(math.prod(c.sizes) for c in nonempty)
    if covered != math.prod(full_shape):
        raise MetadataError(f"{source}: the chunks of tensor {name!r} hold {covered} elements, its shape "
                            f"{list(full_shape)} has {math.prod(full_shape)}; the chunks must cover it exactly")
    _check_no_overlap(name, full_shape, nonempty, source)


def _check_no_overlap(name: str, full_shape: tuple[int, ...], nonempty: Sequence[Chunk], source: str) -> None:
    cuts = [sorted({0, n, *(c.offsets[d] for c in nonempty), *(c.offsets[d] + c.sizes[d] for c in nonempty)})
            for d, n in enumerate(full_shape)]
    cells = math.prod(len(dim_cuts) - 1 for dim_cuts in cuts)
    if cells > MAX_GRID_CELLS_PER_CHUNK * len(nonempty) + 1024:
        raise MetadataError(f"{source}: the {len(nonempty)} chunks of tensor {name!r} do not form a grid (their "
                            f"cuts make {cells} cells); shardkit writes one chunk per cell of a grid, so this "
                            f"file is corrupt or was not written by shardkit")
    marked: set[tuple[int, ...]] = set()
    for c in nonempty:
        spans = [range(bisect.bisect_left(dim_cuts, o), bisect.bisect_left(dim_cuts, o + s))
                 for dim_cuts, o, s in zip(cuts, c.offsets, c.sizes)]
        for cell in itertools.product(*spans):
            if cell in marked:
                raise MetadataError(f"{source}: tensor {name!r} has overlapping chunks (one at offsets "
                                    f"{list(c.offsets)}); each element is stored exactly once")
            marked.add(cell)

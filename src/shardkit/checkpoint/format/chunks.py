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

import math
from dataclasses import dataclass
from typing import Any, Sequence

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.layout import Box, cover_problem
from shardkit.storage.json_io import short_repr

__all__ = ["Chunk", "chunks_to_json", "parse_chunks", "check_cover", "MAX_CHUNKS_PER_TENSOR"]

#: A hostile metadata.json cannot make the cover check quadratic in something huge.
MAX_CHUNKS_PER_TENSOR = 1 << 16

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


def chunks_to_json(chunks: Sequence[Chunk], base_index: dict[str, int] | None = None) -> list[dict]:
    """The chunks as JSON; a chunk whose file is a base's (key ``"<dir>/<file>"``, ``references.py``)
    gets ``"file": "<file>"`` and ``"base": base_index[dir]`` (format version 3)."""
    out = []
    for c in chunks:
        entry = {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "byte_range": [c.begin, c.end]}
        if "/" in c.file:
            base_dir, entry["file"] = c.file.split("/", 1)
            entry["base"] = base_index[base_dir]
        out.append(entry)
    return out


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
    length, an exact cover of ``full_shape``. ``check_file(name, base) -> key`` refuses bad file names
    (``base``: the chunk's ``"base"`` entry, None when it has none)."""
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
        chunks.append(Chunk(check_file(c["file"], c.get("base")), offsets, sizes, begin, end))
    check_cover(name, full_shape, chunks, source=source)
    return tuple(chunks)


def check_cover(name: str, full_shape: tuple[int, ...], chunks: Sequence[Chunk], *, source: str) -> None:
    """Raise :class:`MetadataError` unless ``chunks`` cover ``full_shape`` exactly (no gap, no overlap).

    Linear in the chunks (``layout.cover_problem``). Every layout shardkit
    writes is a grid with one cell per chunk; a layout whose grid has far
    more cells than chunks (only a hand-made file has one) is refused rather
    than checked at a cost the file merely claims. A file holds at most one
    chunk of a tensor.
    """
    seen_files = set()
    for c in chunks:
        if c.file in seen_files:
            raise MetadataError(f"{source}: tensor {name!r} has two chunks in {c.file}; a file holds at most one "
                                f"chunk of a tensor (under the tensor's name)")
        seen_files.add(c.file)
    problem = cover_problem(full_shape, [Box(c.offsets, c.sizes) for c in chunks])
    if problem is not None:
        raise MetadataError(f"{source}: the chunks of tensor {name!r} do not cover its shape {list(full_shape)} "
                            f"exactly, each element once: {problem}")

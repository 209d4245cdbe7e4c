"""The safetensors header: build it, and parse and check an untrusted one.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes
of JSON (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}``),
then the tensor bytes, contiguous, offsets relative to the end of the header.
This module builds and checks that JSON; it reads files only through a
:class:`~shardkit.storage.backends.choose.Reader` and never the tensor bytes.

Example::

    header = read_header(reader)               # -> SafetensorsHeader
    entry = header.tensors["layers.0.w"]       # dtype, shape, begin/end file offsets
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from shardkit import knobs
from shardkit.dtypes import NAME_TO_DTYPE
from shardkit.errors import MetadataError
from shardkit.storage.backends.base import Reader
from shardkit.storage.checksum import FileRecord
from shardkit.layout import bounded_numel
from shardkit.storage.json_io import expect_dict, expect_int, expect_list, expect_str, parse_json_object, short_repr

__all__ = ["TensorEntry", "TensorTable", "SafetensorsHeader", "FileLayout", "build_header", "file_layout",
           "read_header", "parse_header"]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are in a file (absolute file offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class TensorTable(Mapping):
    """``name -> TensorEntry`` of one header, kept compact (a ``TensorEntry`` is built per lookup).

    Holds one small tuple per tensor (``dtype, shape, begin, end``, offsets
    relative to the data), all of them checked by :func:`parse_header`; an
    entry object costs memory only while a caller holds it.
    """

    __slots__ = ("_packed", "_data_start")

    def __init__(self, packed: dict[str, tuple], data_start: int):
        self._packed = packed
        self._data_start = data_start

    def __getitem__(self, name: str) -> TensorEntry:
        dtype, shape, begin, end = self._packed[name]
        return TensorEntry(name, dtype, shape, self._data_start + begin, self._data_start + end)

    def __contains__(self, name: object) -> bool:
        return name in self._packed

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


@dataclass(frozen=True)
class SafetensorsHeader:
    data_start: int
    tensors: Mapping[str, TensorEntry]
    metadata: dict[str, str]
    #: Where the last tensor's bytes end (absolute; ``data_start`` with no tensors).
    data_end: int = 0


def build_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header for ``(name, dtype, shape, nbytes)`` entries, in file order."""
    obj: dict = {}
    if metadata:
        obj["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class FileLayout:
    """Where everything of a safetensors file lies, known before a byte is written.

    ``header``: the length prefix and JSON; ``entries``: every tensor in file
    order with its absolute ``[begin, end)``; ``order[i]``: the position in the
    caller's list of ``entries[i]``; ``size_bytes``: the whole file's size.
    """

    header: bytes
    entries: tuple[TensorEntry, ...]
    order: tuple[int, ...]
    size_bytes: int


def file_layout(tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: dict[str, str] | None) -> FileLayout:
    """The layout of a safetensors file holding ``(name, dtype name, shape)`` tensors, with ``metadata``.

    The one place that orders a file: widest dtype first, then by name (each
    tensor then starts aligned to its element size). ``write_safetensors``
    writes exactly this; a checkpoint's rank 0 computes other ranks' byte
    ranges with it instead of receiving them. Pure: no I/O, no tensor bytes.

    >>> lay = file_layout([("b", "F16", (2,)), ("w", "F32", (2, 2))], {"format": "pt"})
    >>> [(e.name, e.end - e.begin) for e in lay.entries], lay.size_bytes == lay.entries[-1].end
    ([('w', 16), ('b', 4)], True)
    """
    order = sorted(range(len(tensors)), key=lambda i: (-_ITEMSIZE[tensors[i][1]][1], tensors[i][0]))
    sized = [(tensors[i][0], tensors[i][1], tuple(tensors[i][2]),
              math.prod(tensors[i][2]) * _ITEMSIZE[tensors[i][1]][1]) for i in order]
    header = build_header(sized, metadata)
    entries, offset = [], len(header)
    for name, dtype, shape, nbytes in sized:
        entries.append(TensorEntry(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    return FileLayout(header, tuple(entries), tuple(order), offset)


def read_header(reader: Reader, record: FileRecord | None = None) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open in ``reader``.

    With ``record``, a header it has a ``header_checksum`` for is verified
    against it before a field is parsed (:class:`ChecksumError`); a record
    without one (files written before they existed) checks nothing here.

    Everything :func:`parse_header` checks, and also that the tensors cover
    the data exactly, as the safetensors package requires: the first begins
    at data byte 0, each begins where the one before it (by offset) ends, and
    the last ends at the end of the file. Bytes that no tensor describes (a
    gap, a first tensor that does not start at 0, bytes appended to the file)
    raise :class:`MetadataError` naming the tensor. It reads no tensor bytes.
    """
    if reader.size_bytes < 8:
        raise MetadataError(
            f"{reader.name} is {reader.size_bytes} bytes, too short to be a safetensors file "
            f"(needs at least 8); it is truncated or not safetensors"
        )
    (header_len,) = struct.unpack("<Q", reader.read(0, 8))
    limit = min(knobs.MAX_SAFETENSORS_HEADER_BYTES, reader.size_bytes - 8)
    if header_len > limit:
        raise MetadataError(
            f"{reader.name} declares a header of {header_len} bytes, but the file has "
            f"{reader.size_bytes} bytes and headers are limited to "
            f"{knobs.MAX_SAFETENSORS_HEADER_BYTES}; the file is corrupt, truncated or not safetensors"
        )
    header_bytes = reader.read(8, header_len)
    if record is not None and record.header_checksum is not None:
        record.verify_header(struct.pack("<Q", header_len) + header_bytes, file_name=reader.name)
    header = parse_header(reader.name, header_bytes, reader.size_bytes)
    _check_cover(reader.name, header.tensors._packed, reader.size_bytes - header.data_start)
    return header


def parse_header(file_name: str, header_bytes: bytes, file_size: int) -> SafetensorsHeader:
    """Check the JSON header of a file of ``file_size`` bytes; offsets become absolute.

    Every field of every entry is checked here, whichever tensors the caller
    will read (dtype a known name, shape a list of at most
    ``knobs.MAX_TENSOR_NDIM`` ints in ``0..knobs.MAX_TENSOR_DIM``,
    ``data_offsets`` two ints inside the file, byte count = elements x item
    size, no two tensors overlapping, names of at most ``knobs.MAX_NAME_CHARS``
    characters, ``__metadata__`` strings only, no key twice in any object), so
    callers can trust the result; anything else raises :class:`MetadataError`.
    It does not check that the tensors cover the data without gaps
    (:func:`read_header`, which every reader uses, does). It does not require
    a tensor to begin at a multiple of its element size: the safetensors
    package reads such files, and shardkit copies those tensors rather than
    mapping them (``hf.shard_io.map_shard``).

    Work and memory are linear in the header size: entries are checked and
    packed by a hook as the JSON parser meets them (the raw JSON of an entry
    never outlives it), and only entries the quick check refuses are checked
    again by the reference path, whose message names the problem.
    """
    fix = "the file is corrupt, truncated or not safetensors"
    data_start = 8 + len(header_bytes)
    hook = _packing_hook(file_size - data_start)
    obj = parse_json_object(f"{file_name}: the safetensors header", header_bytes, fix=fix, object_hook=hook,
                            unique_keys=True)
    metadata = _metadata(file_name, obj.pop("__metadata__", None))
    if obj and max(map(len, obj)) > knobs.MAX_NAME_CHARS:
        for name in obj:
            expect_str(name, f"{file_name}: a tensor name")
    for name in [name for name, packed in obj.items() if type(packed) is not tuple]:
        entry = _entry(file_name, name, obj[name], data_start, file_size)  # raises, unless the hook was too strict
        obj[name] = (entry.dtype, entry.shape, entry.begin - data_start, entry.end - data_start)
    data_end = _check_layout(file_name, obj, data_start)
    return SafetensorsHeader(data_start, TensorTable(obj, data_start), metadata, data_end)


def _packing_hook(data_bytes: int) -> Callable[[dict], object]:
    """An ``object_hook`` that replaces a well-formed tensor entry by ``(dtype, shape, begin, end)``.

    It accepts only what :func:`_entry` accepts (the same checks, quicker)
    and returns anything else unchanged, for :func:`_entry` to explain. JSON
    yields no tuples, so a tuple in the parsed header is an entry this hook
    checked; one in a wrong place (inside a shape, as ``__metadata__``, as the
    whole header) fails the type checks there. Knobs are read once, here.
    """
    max_ndim, max_dim, shapes, itemsizes, prod = knobs.MAX_TENSOR_NDIM, knobs.MAX_TENSOR_DIM, {}, _ITEMSIZE, math.prod

    def hook(raw: dict):
        if len(raw) != 3:
            return raw
        try:
            dtype, itemsize = itemsizes[raw["dtype"]]
            shape, offsets = raw["shape"], raw["data_offsets"]
        except (KeyError, TypeError):
            return raw
        if type(shape) is not list or type(offsets) is not list or len(offsets) != 2 or len(shape) > max_ndim:
            return raw
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_bytes:
            return raw
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= max_dim:
                return raw
        if prod(shape) * itemsize != end - begin:  # at most 64 dims of 63 bits: a bounded product
            return raw
        if begin == end and prod(max(dim, 1) for dim in shape) >= 1 << 63:  # empty, but no tensor has its strides
            return raw
        shape = tuple(shape)
        return dtype, shapes.setdefault(shape, shape), begin, end  # one tuple per distinct shape

    return hook


#: dtype name -> (the table's own string, item size in bytes).
_ITEMSIZE = {name: (name, dtype.itemsize) for name, dtype in NAME_TO_DTYPE.items()}


def _metadata(file_name: str, raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise MetadataError(f"{file_name}: __metadata__ is {short_repr(raw)}; it must be an object of strings. "
                            f"The file is corrupt or not safetensors")
    return raw


def _entry(file_name: str, name: str, raw: object, data_start: int, file_size: int) -> TensorEntry:
    what = f"{file_name}: the header entry for tensor {short_repr(name)}"
    raw = expect_dict(raw, what)
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in NAME_TO_DTYPE:
        raise MetadataError(f"{what} has dtype {short_repr(dtype)}; known: {', '.join(NAME_TO_DTYPE)}")
    shape = tuple(expect_int(d, f"{what}: a dimension of its shape")
                  for d in expect_list(raw.get("shape"), f"{what}: shape", max_items=knobs.MAX_TENSOR_NDIM))
    offsets = expect_list(raw.get("data_offsets"), f"{what}: data_offsets", max_items=2)
    if len(offsets) != 2:
        raise MetadataError(f"{what}: data_offsets is {short_repr(offsets)}, expected [begin, end]")
    data_bytes = file_size - data_start
    begin = expect_int(offsets[0], f"{what}: data_offsets[0]")
    end = expect_int(offsets[1], f"{what}: data_offsets[1]", low=begin)
    if end > data_bytes:
        raise MetadataError(f"{what} places its data up to byte {data_start + end}, but the file has only "
                            f"{file_size} bytes; the file is truncated")
    itemsize = NAME_TO_DTYPE[dtype].itemsize
    numel = bounded_numel(shape, data_bytes // itemsize)
    if numel is None or end - begin != numel * itemsize:
        needs = "more than the whole file holds" if numel is None else f"{numel * itemsize} bytes"
        raise MetadataError(f"{what}: shape {list(shape)} and dtype {dtype} need {needs}, the header gives "
                            f"it {end - begin} (data_offsets {[begin, end]}); {_FIX}")
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end)


_FIX = "the file is corrupt, truncated or not safetensors"


def _check_cover(file_name: str, packed: dict[str, tuple], data_bytes: int) -> None:
    """Refuse data bytes that no tensor describes (before the first tensor, between two, after the last).

    ``packed`` passed :func:`_check_layout` (no overlaps, all inside the
    data), so the tensors cover the data exactly when their sizes add up to
    it: one pass, no sort. Only a refused file is sorted, to name the gap.
    """
    if sum(end - begin for _, _, begin, end in packed.values()) != data_bytes:
        raise MetadataError(f"{file_name}: {_first_gap(packed, data_bytes)}; safetensors refuses such a file (its "
                            f"tensors must cover the data exactly): it is corrupt, was appended to, or is not safetensors")


def _first_gap(packed: dict[str, tuple], data_bytes: int) -> str:
    """Where the first data bytes that no tensor describes are, in words."""
    expected, before = 0, None
    for name, (_, _, begin, end) in sorted(packed.items(), key=lambda item: item[1][2:]):
        if begin != expected:
            where = "the first tensor must begin at 0" if before is None else \
                f"the tensor before it, {short_repr(before)}, ends at {expected}"
            return (f"tensor {short_repr(name)} begins at data byte {begin}, but {where}: "
                    f"{_bytes_belong(begin - expected)} to no tensor")
        expected, before = end, name
    described = "no tensors" if before is None else f"tensors up to data byte {expected} (the last: {short_repr(before)})"
    extra = data_bytes - expected
    last = "the last byte belongs" if extra == 1 else f"the last {extra} bytes belong"
    return f"its header describes {described}, but the file holds {data_bytes} bytes of data: {last} to no tensor"


def _bytes_belong(count: int) -> str:
    return "1 byte belongs" if count == 1 else f"{count} bytes belong"


def _check_layout(file_name: str, packed: dict[str, tuple], data_start: int) -> int:
    """Refuse overlapping tensors; the absolute offset where the last one ends."""
    # Offsets were bounded by the file size entry by entry (so they fit int64); here only overlaps remain.
    if not packed:
        return data_start
    values = packed.values()
    begins = np.fromiter(map(itemgetter(2), values), np.int64, len(packed))
    ends = np.fromiter(map(itemgetter(3), values), np.int64, len(packed))
    order = np.lexsort((ends, begins))
    clash = np.flatnonzero(begins[order[1:]] < ends[order[:-1]])
    if len(clash):
        name = list(packed)[order[clash[0] + 1]]
        raise MetadataError(f"{file_name}: tensor {short_repr(name)} overlaps the one before it; {_FIX}")
    return data_start + int(ends.max())

"""The safetensors header: build it, and parse and check an untrusted one.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes
of JSON (``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}``),
then the tensor bytes, contiguous, offsets relative to the end of the header.
This module builds and checks that JSON; it reads files only through a
:class:`~shardkit.storage.backend.Reader` and never the tensor bytes.

Example::

    header = read_header(reader)               # -> SafetensorsHeader
    entry = header.tensors["layers.0.w"]       # dtype, shape, begin/end file offsets
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from shardkit import knobs
from shardkit.dtypes import NAME_TO_DTYPE
from shardkit.errors import MetadataError
from shardkit.storage.backend import Reader
from shardkit.layout import bounded_numel
from shardkit.storage.json_io import expect_dict, expect_int, expect_list, expect_str, parse_json_object, short_repr

__all__ = ["TensorEntry", "SafetensorsHeader", "build_header", "read_header", "parse_header"]


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


@dataclass(frozen=True)
class SafetensorsHeader:
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


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


def read_header(reader: Reader) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open in ``reader``."""
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
    return parse_header(reader.name, reader.read(8, header_len), reader.size_bytes)


def parse_header(file_name: str, header_bytes: bytes, file_size: int) -> SafetensorsHeader:
    """Check the JSON header of a file of ``file_size`` bytes; offsets become absolute.

    Every field is type-checked here (dtype a known name, shape a list of at
    most ``knobs.MAX_TENSOR_NDIM`` non-negative ints, ``data_offsets`` two ints
    inside the file, byte count = elements x item size, no overlaps,
    ``__metadata__`` strings only), so callers can trust the result; anything
    else raises :class:`MetadataError`. Work and memory are linear in the header size.
    """
    fix = "the file is corrupt, truncated or not safetensors"
    obj = parse_json_object(f"{file_name}: the safetensors header", header_bytes, fix=fix)
    data_start = 8 + len(header_bytes)
    metadata = _metadata(file_name, obj.pop("__metadata__", None))
    tensors = {}
    for name in list(obj):  # pop as we go: the raw JSON of an entry is freed once it is converted
        expect_str(name, f"{file_name}: a tensor name")
        tensors[name] = _entry(file_name, name, obj.pop(name), data_start, file_size)
    _check_layout(file_name, tensors, data_start, file_size)
    return SafetensorsHeader(data_start, tensors, metadata)


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


def _check_layout(file_name: str, tensors: dict[str, TensorEntry], data_start: int, file_size: int) -> None:
    # Offsets were bounded by the file size entry by entry; here only overlaps remain.
    position = data_start
    for entry in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if entry.begin < position:
            raise MetadataError(f"{file_name}: tensor {short_repr(entry.name)} overlaps the one before it; {_FIX}")
        position = entry.end

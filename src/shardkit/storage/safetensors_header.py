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
import math
import struct
from dataclasses import dataclass

from shardkit import knobs
from shardkit.dtypes import NAME_TO_DTYPE
from shardkit.errors import MetadataError
from shardkit.storage.backend import Reader
from shardkit.storage.json_io import parse_json_object

__all__ = ["TensorEntry", "SafetensorsHeader", "build_header", "read_header", "parse_header"]


@dataclass(frozen=True)
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
    """Check the JSON header of a file of ``file_size`` bytes; offsets become absolute."""
    obj = parse_json_object(f"{file_name}: the safetensors header", header_bytes,
                            fix="the file is corrupt, truncated or not safetensors")
    data_start = 8 + len(header_bytes)
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise MetadataError(f"{file_name}: __metadata__ must be an object of strings")
    tensors = {name: _entry(file_name, name, raw, data_start) for name, raw in obj.items()}
    _check_layout(file_name, tensors, data_start, file_size)
    return SafetensorsHeader(data_start, tensors, metadata)


def _entry(file_name: str, name: str, raw: object, data_start: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad shape {shape}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise ValueError(f"bad data_offsets {[begin, end]}")
    except (KeyError, TypeError, ValueError) as e:
        raise MetadataError(f"{file_name}: the header entry for tensor {name!r} is malformed ({e})") from e
    if dtype not in NAME_TO_DTYPE:
        raise MetadataError(
            f"{file_name}: tensor {name!r} has dtype {dtype!r}; known: {', '.join(NAME_TO_DTYPE)}"
        )
    itemsize = NAME_TO_DTYPE[dtype].itemsize
    if (end - begin) != math.prod(shape) * itemsize:
        raise MetadataError(
            f"{file_name}: tensor {name!r} of shape {list(shape)} and dtype {dtype} needs "
            f"{math.prod(shape) * itemsize} bytes, the header gives it {end - begin}"
        )
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end)


def _check_layout(file_name: str, tensors: dict[str, TensorEntry], data_start: int, file_size: int) -> None:
    data_end = max((t.end for t in tensors.values()), default=data_start)
    if data_end > file_size:
        raise MetadataError(
            f"{file_name}: the header places tensor data up to byte {data_end}, but the file has "
            f"only {file_size} bytes; the file is truncated"
        )
    position = data_start
    for entry in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if entry.begin < position:
            raise MetadataError(f"{file_name}: tensor {entry.name!r} overlaps the one before it")
        position = entry.end

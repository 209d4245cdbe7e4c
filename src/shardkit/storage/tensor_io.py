"""Tensor bytes from safetensors files into caller-owned memory, verified by block.

Reading fills caller-owned buffers at given file offsets, verifying the
blocks those reads touch when a :class:`FileRecord` is given. This module
moves bytes; it does not decide which bytes a rank needs (that is the
checkpoint planner's job). Writing is in ``writer.py``.

Example::

    with store.open_reader(path) as r:
        header = read_header(r)
        out = torch.empty(header.tensors["w"].shape, dtype=w.dtype)
        read_ranges(r, [(header.tensors["w"].begin, byte_view(out))], record)
"""

from __future__ import annotations

import torch

from shardkit import knobs
from shardkit.storage.backend import Reader
from shardkit.storage.checksum import FileRecord

__all__ = ["byte_view", "read_ranges"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview over a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_ranges(reader: Reader, reads: list[tuple[int, memoryview]], record: FileRecord | None = None) -> None:
    """Fill each ``(file_offset, buffer)`` in ``reads`` from the file.

    With ``record``, every checksum block that a read touches is verified
    (raising :class:`~shardkit.errors.ChecksumError`); a block that lies
    wholly inside one buffer is read straight into it and hashed there, so
    verification adds hashing but no copy for large reads.
    """
    reads = [(offset, buf.cast("B") if buf.format != "B" else buf) for offset, buf in reads if len(buf)]
    if record is None:
        for offset, buf in reads:
            _read_chunked(reader, offset, buf)
        return
    _check_size(reader, record)
    for block in sorted({b for offset, buf in reads for b in _blocks(offset, len(buf), record.block_bytes)}):
        _read_block(reader, record, block, reads)


def _read_chunked(reader: Reader, offset: int, buf: memoryview) -> None:
    step = knobs.IO_CHUNK_BYTES
    for start in range(0, len(buf), step):
        reader.read_into(offset + start, buf[start : start + step])


def _blocks(offset: int, length: int, block_bytes: int) -> range:
    return range(offset // block_bytes, (offset + length - 1) // block_bytes + 1)


def _check_size(reader: Reader, record: FileRecord) -> None:
    if reader.size_bytes != record.bytes:
        from shardkit.errors import IncompleteCheckpointError

        raise IncompleteCheckpointError(
            f"{reader.name} is {reader.size_bytes} bytes, the manifest records {record.bytes}; "
            f"the file was truncated or replaced after the save"
        )


def _read_block(reader: Reader, record: FileRecord, block: int, reads: list[tuple[int, memoryview]]) -> None:
    start = block * record.block_bytes
    stop = min(start + record.block_bytes, record.bytes)
    covering = [i for i, (off, buf) in enumerate(reads) if off <= start and stop <= off + len(buf)]
    if covering:
        off, buf = reads[covering[0]]
        source = buf[start - off : stop - off]
    else:
        source = memoryview(bytearray(stop - start))
    reader.read_into(start, source)
    record.verify_block(block, source, file_name=reader.name)
    for i, (offset, buf) in enumerate(reads):
        lo, hi = max(start, offset), min(stop, offset + len(buf))
        if lo < hi and not (covering and i == covering[0]):
            buf[lo - offset : hi - offset] = source[lo - start : hi - start]

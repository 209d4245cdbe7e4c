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
import xxhash

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
    verification adds hashing but no copy for large reads. Other blocks
    stream through one scratch buffer of at most ``knobs.IO_CHUNK_BYTES``,
    whatever the recorded block size; one sweep over the blocks in file order
    keeps the work linear in blocks + reads. On a mismatch, buffers may
    already hold the block's unverified bytes.
    """
    reads = [(offset, buf.cast("B") if buf.format != "B" else buf) for offset, buf in reads if len(buf)]
    if record is None:
        for offset, buf in reads:
            _read_chunked(reader, offset, buf)
        return
    _check_size(reader, record)
    reads.sort(key=lambda r: r[0])
    scratch: list[memoryview] = []  # allocated on first need, then reused
    active: list[tuple[int, memoryview]] = []
    next_read = 0
    for block in _touched_blocks(reads, record.block_bytes):
        start = block * record.block_bytes
        stop = min(start + record.block_bytes, record.bytes)
        while next_read < len(reads) and reads[next_read][0] < stop:
            active.append(reads[next_read])
            next_read += 1
        active = [(off, buf) for off, buf in active if off + len(buf) > start]
        _read_block(reader, record, block, start, stop, active, scratch)


def _touched_blocks(reads: list[tuple[int, memoryview]], block_bytes: int):
    """Indices of the blocks the (offset-sorted) reads touch, ascending, each once."""
    last = -1
    for offset, buf in reads:
        for block in range(max(last + 1, offset // block_bytes), (offset + len(buf) - 1) // block_bytes + 1):
            yield block
            last = block


def _read_chunked(reader: Reader, offset: int, buf: memoryview) -> None:
    step = knobs.IO_CHUNK_BYTES
    for start in range(0, len(buf), step):
        reader.read_into(offset + start, buf[start : start + step])


def _check_size(reader: Reader, record: FileRecord) -> None:
    if reader.size_bytes != record.bytes:
        from shardkit.errors import IncompleteCheckpointError

        raise IncompleteCheckpointError(
            f"{reader.name} is {reader.size_bytes} bytes, the manifest records {record.bytes}; "
            f"the file was truncated or replaced after the save"
        )


def _read_block(reader: Reader, record: FileRecord, block: int, start: int, stop: int,
                active: list[tuple[int, memoryview]], scratch: list[memoryview]) -> None:
    covering = next((i for i, (off, buf) in enumerate(active) if off <= start and stop <= off + len(buf)), None)
    if covering is not None:
        off, buf = active[covering]
        source = buf[start - off : stop - off]
        reader.read_into(start, source)
        record.verify_block(block, source, file_name=reader.name)
        _copy_out(source, start, active, skip=covering)
        return
    if not scratch:
        scratch.append(memoryview(bytearray(min(knobs.IO_CHUNK_BYTES, record.block_bytes, record.bytes))))
    hasher = xxhash.xxh3_64()
    for position in range(start, stop, len(scratch[0])):
        source = scratch[0][: min(len(scratch[0]), stop - position)]
        reader.read_into(position, source)
        hasher.update(source)
        _copy_out(source, position, active, skip=None)
    record.verify_digest(block, hasher.hexdigest(), stop - start, file_name=reader.name)


def _copy_out(source: memoryview, source_offset: int, active: list[tuple[int, memoryview]], skip: int | None) -> None:
    """Copy the part of ``source`` (file bytes at ``source_offset``) that each active read wants."""
    end = source_offset + len(source)
    for i, (offset, buf) in enumerate(active):
        lo, hi = max(source_offset, offset), min(end, offset + len(buf))
        if lo < hi and i != skip:
            buf[lo - offset : hi - offset] = source[lo - source_offset : hi - source_offset]

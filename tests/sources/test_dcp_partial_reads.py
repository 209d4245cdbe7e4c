"""A box that covers only whole rows of a DCP chunk reads just those rows' bytes (unverified: a CRC-32 covers
a whole record); a whole chunk, or a part that is not whole rows, is read whole and verified."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from byte_counting import counting_reads
from shardkit.errors import ChecksumError
from shardkit.sources import DcpCheckpoint
from shardkit.sources.dcp_record import tensor_data_span


def _saved(tmp_path):
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    dcp.save({"w": w}, checkpoint_id=str(tmp_path), no_dist=True)
    return w


def _data_start(tmp_path) -> tuple[str, int]:
    """The .distcp file holding 'w' and the file offset of its first data byte."""
    with DcpCheckpoint(str(tmp_path)) as ck:
        chunk, = ck.tensors["w"].chunks
    path = os.path.join(tmp_path, chunk.file_name)
    with open(path, "rb") as f:
        f.seek(chunk.offset)
        record = f.read(chunk.length)
    start, _, _ = tensor_data_span(io.BytesIO(record), torch.float32, (64, 32))
    return path, chunk.offset + start


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_whole_rows_of_a_chunk_read_only_their_bytes(tmp_path):
    w = _saved(tmp_path)
    with DcpCheckpoint(str(tmp_path)) as ck, counting_reads() as counted:
        part = ck.read_box("w", (8, 0), (4, 32))
    assert torch.equal(part, w[8:12])
    record = sum(c.length for c in DcpCheckpoint(str(tmp_path)).tensors["w"].chunks)
    assert counted.total(".distcp") < record // 4       # was: the whole record, then a copy of 4 rows


def test_a_part_read_is_not_verified_a_whole_read_and_a_column_read_are(tmp_path):
    w = _saved(tmp_path)
    path, start = _data_start(tmp_path)
    _flip(path, start + 40 * 32 * 4)                    # a byte of row 40
    with DcpCheckpoint(str(tmp_path)) as ck:
        assert torch.equal(ck.read_box("w", (0, 0), (16, 32)), w[:16])   # rows 0..15: read alone, unverified
        with pytest.raises(ChecksumError, match="CRC-32"):
            ck.read("w")                                                 # the whole record: verified
        with pytest.raises(ChecksumError, match="CRC-32"):
            ck.read_box("w", (0, 0), (16, 8))                            # columns: read whole, verified


def test_a_cast_load_of_a_dcp_reads_whole_chunks_and_still_verifies_them(tmp_path, monkeypatch):
    import shardkit.checkpoint as ckpt
    import shardkit.checkpoint.loading.fill as fill_module

    monkeypatch.setattr(fill_module, "SLAB_BYTES", 256)           # slabs would split the chunk, unverified
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).to(torch.bfloat16)
    dcp.save({"w": w}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"w": torch.zeros(64, 32)}
    ckpt.load(state, str(tmp_path), cast=True)
    assert torch.equal(state["w"], w.float())
    with DcpCheckpoint(str(tmp_path)) as ck:
        chunk, = ck.tensors["w"].chunks
    with open(os.path.join(tmp_path, chunk.file_name), "rb") as f:
        f.seek(chunk.offset)
        start, _, _ = tensor_data_span(io.BytesIO(f.read(chunk.length)), torch.bfloat16, (64, 32))
    _flip(os.path.join(tmp_path, chunk.file_name), chunk.offset + start + 40 * 32 * 2)
    with pytest.raises(ChecksumError, match="CRC-32"):
        ckpt.load({"w": torch.zeros(64, 32)}, str(tmp_path), cast=True)

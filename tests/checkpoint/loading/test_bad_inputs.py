"""Damaged or hostile checkpoints: each raises its typed error with a helpful message,
and validate_distributed reports each as a readable problem."""

import json
import os
import struct

import pytest
import torch

from ckpt_helpers import save_full_v1
from shardkit import knobs
from shardkit.checkpoint import load_distributed, load_region, reshard, validate_distributed
from shardkit.errors import (
    ChecksumError,
    IncompleteCheckpointError,
    MetadataError,
    MissingShardError,
    TensorMismatchError,
)


@pytest.fixture()
def ckpt(tmp_path):
    # Format version 1 (ckpt_helpers.save_full_v1): these tests edit its fields and rank manifests.
    save_full_v1({"w": torch.arange(64, dtype=torch.float32).reshape(16, 4), "b": torch.ones(3)},
                 tmp_path, 2, {"w": 0}, extra={"step": 3})
    return tmp_path


def _edit_metadata(directory, fn):
    path = directory / "metadata.json"
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _problems(directory):
    report = validate_distributed(directory)
    assert not report.ok
    return "\n".join(report.problems)


def test_truncated_file(ckpt):
    path = ckpt / "rank_1.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IncompleteCheckpointError, match=r"rank_1.safetensors is \d+ bytes, the manifest records \d+; the file is truncated"):
        load_distributed(ckpt, 1, 2)
    assert "rank_1.safetensors is short (truncated)" in _problems(ckpt)


def test_flipped_byte_in_data(ckpt, monkeypatch):
    path = ckpt / "rank_0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="do not match their checksum.*the file is corrupt"):
        load_distributed(ckpt, 0, 2, verify=True)
    monkeypatch.setattr(knobs, "VERIFY_ON_LOAD", True)
    with pytest.raises(ChecksumError, match="do not match their checksum"):
        load_region(ckpt, "w", (0, 0), (1, 4))
    assert load_distributed(ckpt, 0, 2, verify=False)["w"].shape == (8, 4)  # verification is optional
    assert "rank_0.safetensors is corrupt: bytes 0.." in _problems(ckpt)


def test_flipped_byte_in_header(ckpt):
    path = ckpt / "rank_1.safetensors"
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="rank_1.safetensors: bytes 0.."):
        load_distributed(ckpt, 1, 2, verify=True)
    assert "rank_1.safetensors" in _problems(ckpt)


def test_invalid_json(ckpt):
    (ckpt / "metadata.json").write_text('{"format": "shardkit.distributed", "num_r')
    with pytest.raises(MetadataError, match="metadata.json is not valid JSON.*corrupt or was cut short"):
        load_distributed(ckpt, 0, 2)
    assert "not valid JSON" in _problems(ckpt)


def test_unknown_format_version(ckpt):
    _edit_metadata(ckpt, lambda o: o.update(format_version=7))
    with pytest.raises(MetadataError, match="format_version 7; this shardkit supports 1"):
        load_distributed(ckpt, 0, 2)
    assert "format_version 7" in _problems(ckpt)


def test_shard_sizes_that_do_not_sum(ckpt):
    _edit_metadata(ckpt, lambda o: o["tensor_specs"]["w"].update(shard_sizes=[8, 9]))
    with pytest.raises(MetadataError, match=r"shard_sizes \[8, 9\] of tensor 'w' sum to 17, but dimension 0 .* is 16"):
        reshard(ckpt, 2, 3, 0)
    assert "sum to 17" in _problems(ckpt)


def test_missing_rank_file(ckpt):
    os.remove(ckpt / "rank_1.safetensors")
    with pytest.raises(MissingShardError, match="rank_1.safetensors is missing.*save never finished"):
        load_distributed(ckpt, 2, 3)
    assert load_distributed(ckpt, 0, 3)["w"].shape == (6, 4)  # rank 0 of 3 needs only rank_0's bytes
    assert "rank_1.safetensors is missing (rank 1's data file)" in _problems(ckpt)


def test_missing_manifest(ckpt):
    os.remove(ckpt / "metadata.json")
    with pytest.raises(IncompleteCheckpointError, match="has no metadata.json: the save never finished"):
        load_distributed(ckpt, 0, 2)
    assert "no metadata.json" in _problems(ckpt)


def test_missing_rank_manifest_without_group(ckpt):
    os.remove(ckpt / "rank_1.json")
    with pytest.raises(IncompleteCheckpointError, match="rank 1 never finished its save"):
        load_distributed(ckpt, 0, 2)
    assert "rank 1 never finished" in _problems(ckpt)


def test_hostile_header_size(ckpt):
    path = ckpt / "rank_0.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**60) + data[8:])
    with pytest.raises(MetadataError, match=f"declares a header of {2**60} bytes"):
        load_distributed(ckpt, 0, 2, verify=False)
    assert f"declares a header of {2**60} bytes" in _problems(ckpt)


def test_dtype_mismatch(ckpt):
    _edit_metadata(ckpt, lambda o: o["tensor_specs"]["w"].update(dtype="F16"))
    with pytest.raises(TensorMismatchError, match="tensor 'w' in rank_0.safetensors is F32, the metadata says F16"):
        load_distributed(ckpt, 0, 2)
    assert "tensor 'w' is F32, metadata.json says F16" in _problems(ckpt)


def test_header_shape_mismatch(ckpt):
    _edit_metadata(ckpt, lambda o: o["tensor_specs"]["w"].update(full_shape=[16, 2]))
    with pytest.raises(TensorMismatchError, match=r"has shape \[8, 4\], the metadata gives this chunk \[8, 2\]"):
        load_distributed(ckpt, 0, 2)
    assert "gives rank 0 the shape [8, 2]" in _problems(ckpt)


def test_rank_out_of_range(ckpt):
    with pytest.raises(MetadataError, match="rank 5 is out of range for world_size 2"):
        load_distributed(ckpt, 5, 2)
    with pytest.raises(MetadataError, match="new_rank 3 is out of range for world_size 3"):
        reshard(ckpt, 2, 3, 3)


def test_unknown_name_and_bad_box(ckpt):
    with pytest.raises(TensorMismatchError, match="has no tensor 'nope'; it holds: b, w"):
        load_region(ckpt, "nope", (0,), (1,))
    with pytest.raises(TensorMismatchError, match="key 'nope' is not in the checkpoint"):
        load_distributed(ckpt, 0, 2, keys=["nope"])


def test_hostile_file_name_in_manifest(ckpt):
    def poison(o):
        o["files"]["../escape.safetensors"] = o["files"].pop("rank_0.safetensors")
    _edit_metadata(ckpt, poison)
    with pytest.raises(MetadataError, match="'../escape.safetensors'.*only plain relative names"):
        load_distributed(ckpt, 0, 2)


def test_missing_directory(tmp_path):
    with pytest.raises(MissingShardError, match="does not exist"):
        load_distributed(tmp_path / "nowhere", 0, 1)
    assert "does not exist" in _problems(tmp_path / "nowhere")


@pytest.mark.parametrize("block_bytes", [768, 3072])   # neither divides the read-job window (1024 here)
def test_object_store_load_verifies_blocks_that_straddle_job_windows(monkeypatch, block_bytes):
    # Read jobs cover whole blocks: a block cut between two jobs would reach each
    # only in part, and an object store reads such a block unverified.
    import fsspec

    from shardkit.checkpoint import save_distributed
    import shardkit.checkpoint.loading.execute as execute

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(execute, "_JOB_BYTES", 1024)
    url = f"memory://shardkit-straddle-{block_bytes}/ck"
    save_distributed({"w": torch.arange(4096, dtype=torch.float32)}, url, 0, 1, None)
    fs = fsspec.filesystem("memory")
    data_file = max(fs.find(url), key=lambda p: fs.size(p))
    data = bytearray(fs.cat_file(data_file))
    data[block_bytes + 300] ^= 0x01                     # a block that crosses the window edge at 1024
    fs.pipe_file(data_file, bytes(data))
    with pytest.raises(ChecksumError, match="do not match their checksum"):
        load_distributed(url, 0, 1, verify=True)
    fs.rm(url, recursive=True)

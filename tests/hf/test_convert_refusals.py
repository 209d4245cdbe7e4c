"""Conversions refuse bad arguments with typed errors before writing anything."""

import os

import pytest
import torch

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_distributed, save_distributed
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.hf import load_checkpoint, load_shard_index, save_checkpoint, validate_checkpoint
from shardkit.hf.convert import distributed_to_hf, hf_to_distributed


def _dist(tmp_path) -> str:
    path = str(tmp_path / "dist")
    save_distributed({"a": torch.arange(300.0), "b": torch.ones(300)}, path, 0, 1, None)
    return path


def _hf(tmp_path) -> str:
    path = str(tmp_path / "hf")
    save_checkpoint(path, {"w": torch.arange(4.0)}, safetensors=True)
    return path


def _snapshot(path) -> dict:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


@pytest.mark.parametrize("size, shards", [("1GB", 1), ("1KB", 2), ("1KiB", 2), ("3000", 1)])
def test_distributed_to_hf_reads_size_strings_as_save_checkpoint_does(tmp_path, size, shards):
    out = str(tmp_path / "out")
    distributed_to_hf(_dist(tmp_path), out, max_shard_size=size)
    assert len(set(load_shard_index(out, "model.safetensors.index.json")["weight_map"].values())) == shards
    assert load_checkpoint(out, None)["a"].tolist() == list(map(float, range(300)))


def test_distributed_to_hf_refuses_a_bad_size_before_touching_the_target(tmp_path):
    dist, hf = _dist(tmp_path), _hf(tmp_path)
    before = _snapshot(hf)
    with pytest.raises(MetadataError, match="1.5GB"):
        distributed_to_hf(dist, hf, max_shard_size="1.5GB")
    assert _snapshot(hf) == before


@pytest.mark.parametrize("metadata", [{"loss": float("nan")}, {"step": torch.tensor(3)}], ids=["nan", "tensor"])
def test_distributed_to_hf_refuses_bad_metadata_and_keeps_the_previous_export(tmp_path, metadata):
    dist, hf = _dist(tmp_path), _hf(tmp_path)
    before = _snapshot(hf)
    with pytest.raises(MetadataError, match="metadata\\['(loss|step)'\\]"):
        distributed_to_hf(dist, hf, metadata=metadata)
    assert _snapshot(hf) == before
    assert validate_checkpoint(hf)


_BAD_SPECS = [
    pytest.param(2, ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (3, 3))}), MetadataError, "sum to 6",
                 id="sizes-do-not-sum"),
    pytest.param(3, ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))}), MetadataError, "built for 2 ranks",
                 id="spec-for-fewer-ranks"),
    pytest.param(2, ShardMetadata(2, {"w": TensorShardSpec((4,), 1, (2, 2))}), MetadataError, "shard_dim 1",
                 id="shard-dim-past-the-tensor"),
    pytest.param(0, None, MetadataError, "world_size", id="world-size-0"),
    pytest.param(-1, None, MetadataError, "world_size", id="world-size-negative"),
    pytest.param(2, ShardMetadata(2, {"w": TensorShardSpec((6,), 0, (3, 3))}), TensorMismatchError, "shape \\[4\\]",
                 id="full-shape-differs-from-saved"),
    pytest.param(2, ShardMetadata(2, {"v": TensorShardSpec((4,), 0, (2, 2))}), TensorMismatchError, "'v'",
                 id="spec-names-an-absent-tensor"),
]


@pytest.mark.parametrize("world_size, spec, error, words", _BAD_SPECS)
def test_hf_to_distributed_refuses_a_bad_layout_before_writing(tmp_path, world_size, spec, error, words):
    out = tmp_path / "out"
    with pytest.raises(error, match=words):
        hf_to_distributed(_hf(tmp_path), str(out), world_size=world_size, shard_spec=spec)
    assert not out.exists() or not os.listdir(out)


def test_hf_to_distributed_with_a_good_spec_still_shards(tmp_path):
    out = str(tmp_path / "out")
    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (1, 3))})
    hf_to_distributed(_hf(tmp_path), out, world_size=2, shard_spec=spec)
    assert load_distributed(out, 1, 2)["w"].tolist() == [1.0, 2.0, 3.0]

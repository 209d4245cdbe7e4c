"""The directory of checkpoints: completeness, latest, rotation, metrics, from_pretrained links."""

import os
import time

import pytest
import torch
from hf_helpers import assert_same_state, tiny_llama

from shardkit.errors import MetadataError
from shardkit.hf import (
    CheckpointMeta,
    checkpoint_problems,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    load_checkpoint_metrics,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    save_checkpoint,
    save_checkpoint_metrics,
    validate_checkpoint,
)
from shardkit.hf.links import create_pretrained_symlinks


def _sd(v=0.0, n=4):
    return {f"w{i}": torch.full((100,), v + i) for i in range(n)}


def _save(model_dir, ckpt_id, safetensors=True, v=0.0):
    path = next_checkpoint_path(str(model_dir), ckpt_id)
    save_checkpoint(path, _sd(v), safetensors=safetensors, max_shard_size=800)
    return path


def test_next_checkpoint_path(tmp_path):
    assert next_checkpoint_path(str(tmp_path), 12) == str(tmp_path / "checkpoints" / "checkpoint-12")


@pytest.mark.parametrize("safetensors", [True, False])
def test_metadata_and_validation(tmp_path, safetensors):
    path = _save(tmp_path, 1, safetensors)
    meta = get_checkpoint_metadata(path)
    assert meta == CheckpointMeta(
        "model.safetensors.index.json" if safetensors else "pytorch_model.bin.index.json", True, safetensors)
    assert validate_checkpoint(path) and checkpoint_problems(path) == []
    assert get_checkpoint_metadata(str(tmp_path)) is None and not validate_checkpoint(str(tmp_path))


def test_shards_without_index_are_incomplete(tmp_path):
    path = _save(tmp_path, 1)
    os.remove(os.path.join(path, "model.safetensors.index.json"))  # crash before the index was written
    assert not validate_checkpoint(path)


@pytest.mark.parametrize("safetensors", [True, False])
def test_missing_or_truncated_shard_is_incomplete(tmp_path, safetensors):
    path = _save(tmp_path, 1, safetensors)
    ext = "safetensors" if safetensors else "bin"
    shard = os.path.join(path, f"{'model' if safetensors else 'pytorch_model'}-00002-of-00002.{ext}")
    size = os.path.getsize(shard)
    os.truncate(shard, size - 10)
    assert not validate_checkpoint(path)
    assert any("bytes" in p or "truncated" in p for p in checkpoint_problems(path))
    os.remove(shard)
    assert "missing" in checkpoint_problems(path)[0]


def test_extra_bytes_and_wrong_tensors_are_incomplete(tmp_path):
    path = _save(tmp_path, 1)
    shard = os.path.join(path, "model-00001-of-00002.safetensors")
    with open(shard, "ab") as f:
        f.write(b"junk")
    assert "header describes" in " ".join(checkpoint_problems(path))


def test_latest_uses_numeric_id_not_name_or_mtime(tmp_path):
    _save(tmp_path, 10)
    time.sleep(0.01)
    _save(tmp_path, 9)
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint-10")


def test_latest_skips_an_interrupted_save(tmp_path):
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    os.remove(os.path.join(p2, "model.safetensors.index.json"))
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint-1")
    assert find_latest_checkpoint(str(tmp_path / "nothing")) is None


def test_latest_falls_back_to_mtime(tmp_path):
    for name in ("best-a", "zzz-old"):
        save_checkpoint(str(tmp_path / "checkpoints" / name), _sd(), safetensors=True)
    old = tmp_path / "checkpoints" / "zzz-old" / "model.safetensors.index.json"
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert find_latest_checkpoint(str(tmp_path)).endswith("best-a")


def test_rotation_keeps_best_and_preserved(tmp_path):
    paths = [_save(tmp_path, i) for i in range(1, 7)]
    maybe_delete_oldest_checkpoint(str(tmp_path), 3, best_checkpoint=paths[0], preserved_checkpoints=[paths[1]])
    left = sorted(os.listdir(tmp_path / "checkpoints"))
    assert left == ["checkpoint-1", "checkpoint-2", "checkpoint-6"]
    maybe_delete_oldest_checkpoint(str(tmp_path), 10)
    assert len(os.listdir(tmp_path / "checkpoints")) == 3


def test_rotation_ignores_incomplete(tmp_path):
    paths = [_save(tmp_path, i) for i in range(1, 4)]
    os.remove(os.path.join(paths[2], "model.safetensors.index.json"))  # in progress
    maybe_delete_oldest_checkpoint(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint-2", "checkpoint-3"]


def test_metrics_round_trip(tmp_path):
    path = _save(tmp_path, 1)
    assert load_checkpoint_metrics(path) is None
    save_checkpoint_metrics(path, {"eval_loss": 1.5, "acc": 1})
    assert load_checkpoint_metrics(path) == {"eval_loss": 1.5, "acc": 1.0}
    with pytest.raises(MetadataError, match="numbers"):
        save_checkpoint_metrics(path, {"loss": torch.tensor(1.0)})
    with open(os.path.join(path, "eval_metrics.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(MetadataError, match="not valid JSON"):
        load_checkpoint_metrics(path)


def test_symlinks_relative_dry_run_and_overwrite(tmp_path):
    _save(tmp_path, 1)
    planned = create_pretrained_symlinks(str(tmp_path), dry_run=True)
    assert planned and not any(os.path.lexists(p) for p in planned)
    links = create_pretrained_symlinks(str(tmp_path))
    assert [os.path.basename(p) for p in links][-1] == "model.safetensors.index.json"
    for p in links:
        assert os.path.islink(p) and not os.path.isabs(os.readlink(p))
        assert os.readlink(p).startswith(os.path.join("checkpoints", "checkpoint-1"))
    _save(tmp_path, 2, v=5.0)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"user file")
    with pytest.raises(FileExistsError, match="force_overwrite"):
        create_pretrained_symlinks(str(tmp_path))
    assert (tmp_path / "model-00001-of-00002.safetensors").read_bytes() == b"user file"
    assert os.readlink(tmp_path / "model.safetensors.index.json").startswith(os.path.join("checkpoints", "checkpoint-1"))
    create_pretrained_symlinks(str(tmp_path), force_overwrite=True)
    assert os.path.islink(tmp_path / "model-00001-of-00002.safetensors")
    assert os.readlink(tmp_path / "model.safetensors.index.json").startswith(os.path.join("checkpoints", "checkpoint-2"))
    with pytest.raises(FileNotFoundError):
        create_pretrained_symlinks(str(tmp_path / "empty"))


def test_from_pretrained_through_symlinks(tmp_path):
    from transformers import LlamaForCausalLM

    src = tiny_llama(tied=True)
    save_checkpoint(next_checkpoint_path(str(tmp_path), 3), src, safetensors=True, max_shard_size=20_000)
    src.config.save_pretrained(str(tmp_path))
    create_pretrained_symlinks(str(tmp_path))
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    os.rename(tmp_path, moved)  # relative links survive a move
    assert_same_state(LlamaForCausalLM.from_pretrained(str(moved)), src)

"""load_checkpoint(mmap=True): tensors over copy-on-write maps of the shards, equal to a normal load."""

import os

import pytest
import torch

from hf_helpers import assert_same_state, mixed_state, tiny_llama
from shardkit.hf import load_checkpoint, save_checkpoint

def _state():
    sd = mixed_state()
    sd["odd"] = torch.arange(3, dtype=torch.int8)  # 3 bytes: what follows may sit at an odd offset
    sd["after_odd"] = torch.randn(7, dtype=torch.float64)
    return sd


def test_dict_mode_mmap_equals_a_normal_load(tmp_path):
    sd = _state()
    save_checkpoint(str(tmp_path), sd, safetensors=True, max_shard_size=600)
    mapped = load_checkpoint(str(tmp_path), None, mmap=True)
    read = load_checkpoint(str(tmp_path), None)
    assert sorted(mapped) == sorted(sd)
    for k, t in sd.items():
        assert mapped[k].dtype == t.dtype and mapped[k].shape == t.shape
        assert torch.equal(mapped[k], read[k]), k


def test_writes_to_mapped_tensors_never_reach_the_file(tmp_path):
    sd = {"w": torch.ones(256, 256)}
    save_checkpoint(str(tmp_path), sd, safetensors=True)
    before = {n: open(os.path.join(tmp_path, n), "rb").read() for n in os.listdir(tmp_path)}
    mapped = load_checkpoint(str(tmp_path), None, mmap=True)
    mapped["w"].mul_(3)  # copy-on-write: private to this process
    assert float(mapped["w"][0, 0]) == 3.0
    after = {n: open(os.path.join(tmp_path, n), "rb").read() for n in os.listdir(tmp_path)}
    assert before == after
    assert float(load_checkpoint(str(tmp_path), None)["w"][0, 0]) == 1.0


def test_mapped_tensors_outlive_the_files_being_replaced(tmp_path):
    save_checkpoint(str(tmp_path), {"w": torch.full((64, 64), 2.0)}, safetensors=True)
    mapped = load_checkpoint(str(tmp_path), None, mmap=True)
    save_checkpoint(str(tmp_path), {"w": torch.full((64, 64), 5.0)}, safetensors=True)  # atomic replace
    assert float(mapped["w"].sum()) == 2.0 * 64 * 64  # the old file's inode lives on under the map
    assert float(load_checkpoint(str(tmp_path), None, mmap=True)["w"][0, 0]) == 5.0


def test_assign_mmap_makes_parameters_views_of_the_files(tmp_path):
    src = tiny_llama(tied=False, seed=3)
    save_checkpoint(str(tmp_path), src, safetensors=True, max_shard_size=20_000)
    dst = tiny_llama(tied=False, seed=4)
    load_checkpoint(str(tmp_path), dst, assign=True, mmap=True)
    assert_same_state(src.state_dict(), dst.state_dict())
    assert all(p.requires_grad for p in dst.parameters())


def test_module_mode_without_assign_still_copies_into_the_parameters(tmp_path):
    src = tiny_llama(tied=False, seed=3)
    save_checkpoint(str(tmp_path), src, safetensors=True)
    dst = tiny_llama(tied=False, seed=4)
    ptrs = {n: p.data_ptr() for n, p in dst.named_parameters()}
    load_checkpoint(str(tmp_path), dst, mmap=True)
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == ptrs
    assert_same_state(src.state_dict(), dst.state_dict())


def test_bin_checkpoints_are_read_as_usual(tmp_path):
    sd = {"a": torch.randn(4, 4)}
    save_checkpoint(str(tmp_path), sd, safetensors=False)
    out = load_checkpoint(str(tmp_path), None, mmap=True)
    assert torch.equal(out["a"], sd["a"])


def test_truncated_shard_is_refused_before_mapping(tmp_path):
    from shardkit.errors import CheckpointError

    save_checkpoint(str(tmp_path), {"w": torch.randn(64, 64)}, safetensors=True)
    shard = next(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    with open(os.path.join(tmp_path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(tmp_path, shard)) - 100)
    with pytest.raises(CheckpointError):
        load_checkpoint(str(tmp_path), None, mmap=True)

"""Zero-copy HF loads by default: tensors over copy-on-write maps where the files are local."""

import os

import pytest
import torch

from shardkit import knobs
from shardkit.hf import load_checkpoint, save_checkpoint
from shardkit.storage import LocalStorage


def _saved(tmp_path):
    sd = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.arange(5, dtype=torch.bfloat16)}
    save_checkpoint(str(tmp_path), sd, safetensors=True)
    return sd


def _count_maps(monkeypatch):
    calls = []
    real = LocalStorage.map_private
    monkeypatch.setattr(LocalStorage, "map_private", lambda self, p: calls.append(p) or real(self, p))
    return calls


def test_default_dict_load_maps_and_is_correct(tmp_path, monkeypatch):
    sd = _saved(tmp_path)
    calls = _count_maps(monkeypatch)
    out = load_checkpoint(str(tmp_path), None)
    assert calls, "the default dict load did not map the file"
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)


def test_writing_a_mapped_tensor_does_not_change_the_file(tmp_path):
    sd = _saved(tmp_path)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    before = {f: (tmp_path / f).read_bytes() for f in files}
    out = load_checkpoint(str(tmp_path), None)
    out["w"].add_(1000.0)
    out["b"].zero_()
    assert {f: (tmp_path / f).read_bytes() for f in files} == before
    again = load_checkpoint(str(tmp_path), None)
    assert torch.equal(again["w"], sd["w"]) and torch.equal(again["b"], sd["b"])


def test_assign_maps_and_plain_module_load_copies(tmp_path, monkeypatch):
    sd = {"weight": torch.randn(4, 3), "bias": torch.randn(4)}
    save_checkpoint(str(tmp_path), sd, safetensors=True)
    calls = _count_maps(monkeypatch)
    copied = torch.nn.Linear(3, 4)
    ptr = copied.weight.data_ptr()
    load_checkpoint(str(tmp_path), copied)
    assert not calls and copied.weight.data_ptr() == ptr and torch.equal(copied.weight, sd["weight"])
    assigned = torch.nn.Linear(3, 4)
    load_checkpoint(str(tmp_path), assigned, assign=True)
    assert calls and torch.equal(assigned.weight, sd["weight"]) and torch.equal(assigned.bias, sd["bias"])


@pytest.mark.parametrize("how", ["argument", "knob"])
def test_opt_out_reads_into_fresh_memory(tmp_path, monkeypatch, how):
    sd = _saved(tmp_path)
    calls = _count_maps(monkeypatch)
    if how == "knob":
        monkeypatch.setattr(knobs, "HF_MMAP_LOADS", False)
        out = load_checkpoint(str(tmp_path), None)
    else:
        out = load_checkpoint(str(tmp_path), None, mmap=False)
    assert not calls and all(torch.equal(out[k], sd[k]) for k in sd)


def test_bin_files_are_copied(tmp_path, monkeypatch):
    sd = {"w": torch.randn(3, 3)}
    save_checkpoint(str(tmp_path), sd, safetensors=False)
    calls = _count_maps(monkeypatch)
    assert torch.equal(load_checkpoint(str(tmp_path), None)["w"], sd["w"]) and not calls


def test_a_bad_mmap_value_is_refused(tmp_path):
    _saved(tmp_path)
    with pytest.raises(TypeError, match="mmap"):
        load_checkpoint(str(tmp_path), None, mmap="yes")

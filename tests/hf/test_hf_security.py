"""Hostile inputs: code-carrying pickles, bad index entries, oversized index and headers."""

import json
import os
import pickle
import struct

import pytest
import torch

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.hf import load_checkpoint, save_checkpoint, validate_checkpoint
from shardkit.storage import LocalStorage


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_pickle_with_code_is_refused_and_nothing_runs(tmp_path, layout):
    marker = tmp_path / "pwned"
    name = "pytorch_model.bin" if layout == "single" else "pytorch_model-00001-of-00001.bin"
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"w": torch.zeros(2), "x": _Evil(str(marker))}, str(d / name))
    if layout == "sharded":
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": name}}))
    with pytest.raises(MetadataError, match="weights_only=True"):
        load_checkpoint(str(d), None)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_legacy_raw_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": _Evil(str(marker))}, f)
    with pytest.raises(MetadataError):
        load_checkpoint(str(tmp_path), None)
    assert not marker.exists()


def test_bin_that_is_not_a_tensor_dict_is_refused(tmp_path):
    torch.save([torch.zeros(1)], str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(MetadataError, match="not a dict of name -> tensor"):
        load_checkpoint(str(tmp_path), None)


@pytest.mark.parametrize("bad", ["/tmp/x.safetensors", "../outside.safetensors", "sub/../../x.safetensors",
                                 "model.bin", "model.safetensors.exe"])
def test_bad_index_entry_is_refused_before_any_shard_is_opened(tmp_path, monkeypatch, bad):
    save_checkpoint(str(tmp_path), {"a": torch.zeros(2)}, safetensors=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["evil"] = bad
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    opened = []
    real = LocalStorage.open_reader
    monkeypatch.setattr(LocalStorage, "open_reader", lambda self, p: opened.append(p) or real(self, p))
    with pytest.raises(MetadataError, match=r"only plain relative names.*fix the entry"):
        load_checkpoint(str(tmp_path), None, keys={"a"})
    assert [os.path.basename(p) for p in opened] == ["model.safetensors.index.json"]
    assert not validate_checkpoint(str(tmp_path))


def test_oversized_index_is_refused(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), {f"w{i}": torch.zeros(1) for i in range(50)}, safetensors=True)
    monkeypatch.setattr(knobs, "MAX_INDEX_BYTES", 256)
    with pytest.raises(MetadataError, match="limit of 256"):
        load_checkpoint(str(tmp_path), None)


def _file_with_header_len(path, header_len, body=b"{}"):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len) + body)


def test_huge_safetensors_header_is_refused(tmp_path):
    _file_with_header_len(tmp_path / "model.safetensors", 2**40)
    with pytest.raises(MetadataError, match="limited to 100000000"):
        load_checkpoint(str(tmp_path), None)


def test_header_limit_is_the_knob(tmp_path, monkeypatch):
    body = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"p": "x" * 300}})
    raw = body.encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    assert list(load_checkpoint(str(tmp_path), None)) == ["w"]
    monkeypatch.setattr(knobs, "MAX_SAFETENSORS_HEADER_BYTES", 100)
    with pytest.raises(MetadataError, match="headers are limited to 100"):
        load_checkpoint(str(tmp_path), None)


def test_header_with_lying_offsets_is_refused(tmp_path):
    body = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + b"\0" * 16)
    with pytest.raises(MetadataError, match="truncated"):
        load_checkpoint(str(tmp_path), None)


@pytest.mark.parametrize("mmap", [True, False])
def test_an_empty_tensor_whose_other_dims_overflow_int64_is_refused(tmp_path, mmap):
    # 0 elements match data_offsets [0, 0], but torch cannot lay the shape out (strides past int64)
    body = json.dumps({"w": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]},
                       "ok": {"dtype": "F32", "shape": [2**20, 0], "data_offsets": [0, 0]}}).encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
    with pytest.raises(MetadataError, match=r"shape \[4611686018427387904, 4611686018427387904, 0\]"):
        load_checkpoint(str(tmp_path), None, mmap=mmap)
    assert not validate_checkpoint(str(tmp_path))

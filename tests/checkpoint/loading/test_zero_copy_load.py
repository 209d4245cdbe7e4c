"""Distributed loads map a rank's output when it is one contiguous byte range of one local file."""

import os

import pytest
import torch

from ckpt_helpers import bits_equal, rank_slice, save_full
from shardkit import knobs
from shardkit.checkpoint import load_distributed, reshard, validate_distributed
from shardkit.errors import ChecksumError
import shardkit.storage.backends.local as local_storage


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "v": torch.randn(6, 8, generator=g).to(torch.bfloat16),
            "r": torch.randn(5, generator=g)}


def _count_maps(monkeypatch):
    calls = []
    real = local_storage._LocalReader.map_range
    monkeypatch.setattr(local_storage._LocalReader, "map_range",
                        lambda self, o, n: calls.append((os.path.basename(self.name), o, n)) or real(self, o, n))
    return calls


def _data_files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def _flip_last_byte(directory):
    # The last byte of every data file is tensor data (headers come first).
    for path in _data_files(directory):
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_same_world_size_load_maps_every_tensor_and_is_correct(tmp_path, monkeypatch):
    full = _state()
    save_full(full, tmp_path, 2, {"w": 0, "v": 1})
    calls = _count_maps(monkeypatch)
    for rank in range(2):
        got = load_distributed(str(tmp_path), rank, 2)
        for name, dim in {"w": 0, "v": 1, "r": None}.items():
            sizes = [4, 4] if name == "w" else [4, 4] if name == "v" else None
            assert bits_equal(got[name], rank_slice(full[name], dim, sizes, rank).contiguous())
    assert len(calls) == 6


def test_resharded_dim0_maps_within_a_chunk_and_copies_across_chunks(tmp_path, monkeypatch):
    full = _state()
    save_full(full, tmp_path, 2, {"w": 0, "v": 1})
    calls = _count_maps(monkeypatch)
    got = reshard(str(tmp_path), 2, 4, 1)  # rows 2..3 of w: inside rank 0's chunk -> mapped
    assert bits_equal(got["w"], full["w"][2:4]) and bits_equal(got["v"], full["v"][:, 2:4])
    assert {name for name, *_ in calls} and len(calls) == 2  # w and the replicated r; v is strided: copied
    whole = reshard(str(tmp_path), 2, 1, 0)  # w spans both chunks: copied
    assert bits_equal(whole["w"], full["w"]) and bits_equal(whole["v"], full["v"])


def test_writing_a_mapped_output_does_not_change_the_file(tmp_path):
    full = _state()
    save_full(full, tmp_path, 1, {})
    before = {p: open(p, "rb").read() for p in _data_files(tmp_path)}
    got = load_distributed(str(tmp_path), 0, 1)
    got["w"].fill_(7.0)
    got["r"].zero_()
    assert {p: open(p, "rb").read() for p in _data_files(tmp_path)} == before
    assert validate_distributed(str(tmp_path)).ok
    assert bits_equal(load_distributed(str(tmp_path), 0, 1)["w"], full["w"])


@pytest.mark.parametrize("how", ["knob", "verify"])
def test_opt_out_copies(tmp_path, monkeypatch, how):
    full = _state()
    save_full(full, tmp_path, 1, {})
    calls = _count_maps(monkeypatch)
    if how == "knob":
        monkeypatch.setattr(knobs, "MAP_LOADS", False)
        got = load_distributed(str(tmp_path), 0, 1)
    else:
        got = load_distributed(str(tmp_path), 0, 1, verify=True)
    assert not calls and bits_equal(got["w"], full["w"])


def test_mapped_load_hashes_its_blocks_and_verify_false_skips_it(tmp_path, monkeypatch):
    # Small blocks: the header's own blocks (always verified) do not reach the flipped byte.
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 64)
    full = _state()
    save_full(full, tmp_path, 1, {})
    _flip_last_byte(tmp_path)
    calls = _count_maps(monkeypatch)
    with pytest.raises(ChecksumError, match="do not match their checksum"):
        load_distributed(str(tmp_path), 0, 1)  # zero-copy, verified before it returns
    assert calls
    load_distributed(str(tmp_path), 0, 1, verify=False)  # asked not to hash
    assert not validate_distributed(str(tmp_path)).ok
    with pytest.raises(ChecksumError):
        load_distributed(str(tmp_path), 0, 1, verify=True)


@pytest.mark.parametrize("how", ["resharded", "in_place", "no_maps"])
def test_a_flipped_byte_is_caught_by_a_default_copying_load(tmp_path, monkeypatch, how):
    full = {n: t for n, t in _state().items() if n != "r"}
    save_full(full, tmp_path, 2, {"w": 1, "v": 1})  # dim 1: a resharded rank's slice is strided
    _flip_last_byte(tmp_path)
    with pytest.raises(ChecksumError, match="do not match their checksum"):
        if how == "resharded":
            reshard(str(tmp_path), 2, 1, 0)
        elif how == "in_place":
            out = {n: torch.empty_like(rank_slice(t, 1, [t.shape[1] // 2 + t.shape[1] % 2, t.shape[1] // 2], 1))
                   for n, t in full.items()}
            load_distributed(str(tmp_path), 1, 2, out=out)
        else:
            monkeypatch.setattr(knobs, "MAP_LOADS", False)
            load_distributed(str(tmp_path), 1, 2)


def test_partly_read_blocks_are_verified_whole(tmp_path, monkeypatch):
    # Small blocks, a read that covers a block only in part: the unread rest is hashed too.
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 64)
    monkeypatch.setattr(knobs, "MAP_LOADS", False)
    full = {"a": torch.arange(40, dtype=torch.float32), "b": torch.arange(40, dtype=torch.float32) + 100}
    save_full(full, tmp_path, 1, {})
    assert bits_equal(load_distributed(str(tmp_path), 0, 1, keys=["b"])["b"], full["b"])
    path = _data_files(tmp_path)[0]
    with open(path, "r+b") as f:  # corrupt a's last byte, which shares a block with b's first bytes
        from shardkit.storage import read_header, storage_for
        store, _ = storage_for(path)
        with store.open_reader(path) as r:
            a_end = read_header(r).tensors["a"].end
        f.seek(a_end - 1)
        f.write(b"\x55")
    with pytest.raises(ChecksumError):
        load_distributed(str(tmp_path), 0, 1, keys=["b"])

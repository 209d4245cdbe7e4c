"""Copying loads fault their large fresh outputs in (MADV_POPULATE_WRITE) before filling them."""

import os

import pytest
import torch

from ckpt_helpers import bits_equal, save_full
from shardkit import knobs
from shardkit.checkpoint import load_distributed
import shardkit.checkpoint.loading.execute as execute
from shardkit.errors import ChecksumError

BIG_BYTES = 3 << 20


@pytest.fixture
def calls(monkeypatch):
    """Copying loads, a 1 MiB prefault threshold, and every advice the load gives, recorded."""
    monkeypatch.setattr(knobs, "MAP_LOADS", False)
    monkeypatch.setattr(knobs, "LOAD_PREFAULT_MIN_BYTES", 1 << 20)
    seen = {"populate": []}
    real_populate = execute.populate_for_write
    monkeypatch.setattr(execute, "populate_for_write", lambda a, n: seen["populate"].append((a, n)) or real_populate(a, n))
    return seen


def _state():
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(BIG_BYTES // 4, generator=g), "small": torch.randn(100, generator=g),
            "empty": torch.zeros(0, 4)}


def test_large_fresh_outputs_are_faulted_in_whole_and_load_the_saved_bytes(tmp_path, calls):
    full = _state()
    save_full(full, tmp_path, 1, {})
    got = load_distributed(str(tmp_path), 0, 1)
    assert all(bits_equal(got[k], full[k]) for k in full)
    big = got["big"]
    assert sorted(calls["populate"]) == [(big.data_ptr(), BIG_BYTES)]  # one slice (under _JOB_BYTES); small ones not


def test_outputs_given_with_out_are_not_touched_and_the_knob_turns_it_off(tmp_path, calls, monkeypatch):
    full = _state()
    save_full(full, tmp_path, 1, {})
    out = {k: torch.empty_like(v) for k, v in full.items()}
    load_distributed(str(tmp_path), 0, 1, out=out)
    assert all(bits_equal(out[k], full[k]) for k in full)
    monkeypatch.setattr(knobs, "LOAD_PREFAULT", False)
    got = load_distributed(str(tmp_path), 0, 1)
    assert all(bits_equal(got[k], full[k]) for k in full)
    assert calls == {"populate": []}


def test_a_prefaulted_load_still_catches_a_flipped_byte(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 1 << 20)  # the flip lies past the header's block
    save_full(_state(), tmp_path, 1, {})
    (data,) = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    with open(data, "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumError):
        load_distributed(str(tmp_path), 0, 1)
    assert calls["populate"]

"""The offline tools (reshard, convert, diff) refuse a checkpoint with a flipped byte instead of copying it.

They read shardkit checkpoints through ``DistributedSource`` (every block a
read touches verified), and the HF exporter through ``open_checkpoint``
(zero-copy and, since issue 32, verified too). A damaged source is an exit
code 1 (reshard, convert) or 2 (diff: trouble), never a written copy under
fresh checksums.
"""

import os

import pytest
import torch

from cli_helpers import in_process
from shardkit import knobs
from shardkit.checkpoint import save
from shardkit.errors import CheckpointError, ChecksumError
from shardkit.storage import read_header, storage_for

BLOCK = 4096


def _flip(directory, name: str, element: int) -> None:
    [path] = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors")]
    store, _ = storage_for(path)
    with store.open_reader(path) as r:
        offset = read_header(r).tensors[name].begin + element * 4 + 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture()
def damaged(tmp_path, monkeypatch):
    """``(damaged distributed checkpoint, a clean HF export of it, a clean distributed copy)``."""
    from shardkit.offline import export_hf

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    g = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)}}
    src, clean = str(tmp_path / "src"), str(tmp_path / "clean")
    save(state, src)
    save(state, clean)
    export_hf(src, str(tmp_path / "hf"))
    _flip(src, "model.w", 40 * 256 + 3)
    return src, str(tmp_path / "hf"), clean


def test_offline_reshard_refuses_a_damaged_source(damaged, tmp_path):
    from shardkit.offline import reshard_checkpoint

    src, _, _ = damaged
    with pytest.raises(ChecksumError, match="'model.w'"):
        reshard_checkpoint(src, str(tmp_path / "out"), 2)
    code, _, err = in_process("reshard", src, tmp_path / "out", "--world-size", "2")
    assert code == 1 and "do not match their checksum" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["hf", "distributed"])
def test_convert_refuses_a_damaged_source(damaged, tmp_path, to):
    src, _, _ = damaged
    code, _, err = in_process("convert", src, tmp_path / "out", "--to", to)
    assert code == 1 and "do not match their checksum" in err
    assert not (tmp_path / "out").exists()


def test_the_hf_exporter_over_open_checkpoint_refuses_a_damaged_source(damaged, tmp_path):
    from shardkit.hf import distributed_to_hf

    src, _, _ = damaged
    with pytest.raises(CheckpointError, match="do not match their checksum"):  # hashed whole before writing
        distributed_to_hf(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_diff_that_reads_refuses_a_damaged_side(damaged):
    from shardkit.offline import diff_checkpoints

    src, hf, clean = damaged
    with pytest.raises(ChecksumError):
        diff_checkpoints(src, hf)                     # different kinds: every tensor read, so verified
    with pytest.raises(ChecksumError):
        diff_checkpoints(src, clean, verify=True)
    code, _, err = in_process("diff", src, hf)
    assert code == 2 and "do not match their checksum" in err
    # Without --verify, two distributed checkpoints compare their recorded checksums: nothing is read.
    assert diff_checkpoints(src, clean).identical

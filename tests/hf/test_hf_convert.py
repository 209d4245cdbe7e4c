"""Distributed <-> HF conversion, and distributed checkpoints in the directory utilities."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from shardkit import knobs
from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_distributed, save_distributed, validate_distributed
from shardkit.errors import TensorMismatchError
from shardkit.hf import (
    find_latest_checkpoint,
    get_checkpoint_metadata,
    load_checkpoint,
    load_shard_index,
    next_checkpoint_path,
    save_checkpoint,
    validate_checkpoint,
)
from shardkit.hf.convert import distributed_to_hf, hf_to_distributed


def _full():
    torch.manual_seed(0)
    return {"emb": torch.randn(12, 8), "layer.w": torch.randn(8, 8).to(torch.bfloat16),
            "layer.b": torch.randn(8), "count": torch.arange(4)}


_SPEC = ShardMetadata(2, {"emb": TensorShardSpec((12, 8), 0, (6, 6)), "layer.w": TensorShardSpec((8, 8), 1, (3, 5))})


def _save_two_ranks(path, full, extra=None):
    for rank in (0, 1):
        local = dict(full)
        local["emb"] = full["emb"].narrow(0, 6 * rank, 6)
        local["layer.w"] = full["layer.w"].narrow(1, 3 * rank, 3 + 2 * rank)
        local.update(extra or {})
        save_distributed(local, str(path), rank, 2, _SPEC)


@pytest.mark.parametrize("safetensors", [True, False])
def test_distributed_to_hf(tmp_path, safetensors):
    full = _full()
    _save_two_ranks(tmp_path / "dist", full, {"step": 7})
    distributed_to_hf(str(tmp_path / "dist"), str(tmp_path / "hf"), safetensors=safetensors, max_shard_size=300)
    out = load_checkpoint(str(tmp_path / "hf"), None)
    assert sorted(out) == sorted(full)
    for k in full:
        assert out[k].dtype == full[k].dtype and torch.equal(out[k], full[k])
    index = load_shard_index(str(tmp_path / "hf"), "model.safetensors.index.json" if safetensors
                             else "pytorch_model.bin.index.json")
    assert index["metadata"]["shardkit_objects"] == {"step": 7}
    assert len(set(index["weight_map"].values())) > 1


def test_a_damaged_source_leaves_the_hf_checkpoint_already_there_untouched(tmp_path):
    from shardkit.errors import ChecksumError, IncompleteCheckpointError

    full = _full()
    _save_two_ranks(tmp_path / "good", full)
    distributed_to_hf(str(tmp_path / "good"), str(tmp_path / "hf"))
    before = sorted(os.listdir(tmp_path / "hf"))
    _save_two_ranks(tmp_path / "bad", {k: v + 1 if v.is_floating_point() else v for k, v in full.items()})
    data = tmp_path / "bad" / "rank_1.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the last tensor rank 1 holds
    data.write_bytes(bytes(raw))
    with pytest.raises((ChecksumError, IncompleteCheckpointError), match="corrupt|damaged"):
        distributed_to_hf(str(tmp_path / "bad"), str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path / "hf")) == before
    out = load_checkpoint(str(tmp_path / "hf"), None)
    assert all(torch.equal(out[k], full[k]) for k in full)


def test_hf_to_distributed_and_back(tmp_path):
    full = _full()
    save_checkpoint(str(tmp_path / "hf"), full, safetensors=True, max_shard_size=300)
    hf_to_distributed(str(tmp_path / "hf"), str(tmp_path / "dist"), world_size=2, shard_spec=_SPEC)
    assert validate_distributed(str(tmp_path / "dist")).ok
    r1 = load_distributed(str(tmp_path / "dist"), 1, 2)
    assert torch.equal(r1["emb"], full["emb"][6:]) and torch.equal(r1["layer.w"], full["layer.w"][:, 3:])
    distributed_to_hf(str(tmp_path / "dist"), str(tmp_path / "hf2"))
    for k, v in load_file(str(tmp_path / "hf2" / "model-00001-of-00001.safetensors")).items():
        assert torch.equal(v, full[k])


def test_hf_bin_and_tied_to_distributed(tmp_path, tied_model):
    save_checkpoint(str(tmp_path / "hf"), tied_model, safetensors=False)
    hf_to_distributed(str(tmp_path / "hf"), str(tmp_path / "dist"))
    out = load_checkpoint(str(tmp_path / "dist"), None)
    assert "head.weight" not in out and torch.equal(out["emb.weight"], tied_model.emb.weight)


def test_distributed_checkpoints_in_the_directory_utilities(tmp_path, tied_model):
    full = _full()
    _save_two_ranks(next_checkpoint_path(str(tmp_path), 5), full)
    p7 = next_checkpoint_path(str(tmp_path), 7)
    _save_two_ranks(p7, full)
    assert get_checkpoint_metadata(p7).distributed and validate_checkpoint(p7)
    assert find_latest_checkpoint(str(tmp_path)) == p7
    os.remove(os.path.join(p7, "rank_1.safetensors"))
    assert not validate_checkpoint(p7)
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint-5")


def test_load_checkpoint_consolidates_a_distributed_one(tmp_path):
    full = _full()
    _save_two_ranks(tmp_path, full)
    m = torch.nn.Module()
    m.emb = torch.nn.Parameter(torch.zeros(12, 8))
    load_checkpoint(str(tmp_path), m)  # the checkpoint's other tensors are not an error (m may be a shard)
    assert torch.equal(m.emb, full["emb"])
    m.extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TensorMismatchError):
        load_checkpoint(str(tmp_path), m)
    load_checkpoint(str(tmp_path), m, strict=False)
    assert torch.equal(load_checkpoint(str(tmp_path), None, keys={"layer.w"})["layer.w"], full["layer.w"])


_CHILD = textwrap.dedent("""
    import os, sys, threading, time
    import torch
    from shardkit.checkpoint import load_consolidated
    from shardkit.hf.convert import distributed_to_hf

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    peak, stop = [0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss()); time.sleep(0.002)
    base = rss()
    t = threading.Thread(target=sample); t.start()
    if sys.argv[3] == "convert":
        distributed_to_hf(sys.argv[1], sys.argv[2])
    else:
        everything = load_consolidated(sys.argv[1], verify=True)  # copies (a default load maps: no RSS)
    stop.set(); t.join()
    print(peak[0] - base)
""")


def _peak_growth(tmp_path, mode):
    # Large blocks straight from mmap, so freed tensors leave RSS (glibc would otherwise keep
    # some in its heap, and the test would measure the allocator, not shardkit).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "dist"), str(tmp_path / "hf"), mode],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_distributed_to_hf_memory_is_bounded_by_the_largest_tensor(tmp_path):
    n, tensor_bytes = 24, 8 << 20
    state = {f"layer.{i}.w": torch.full((tensor_bytes // 4,), float(i)) for i in range(n)}
    save_distributed(state, str(tmp_path / "dist"), 0, 1, None)
    del state
    grown = _peak_growth(tmp_path, "convert")
    # A few tensors at a time, plus the direct-I/O writer's bounce buffers (a constant).
    bounce_bytes = knobs.DIRECT_IO_BLOCK_BYTES * (knobs.DIRECT_IO_QUEUE_DEPTH + 1)
    assert grown < 6 * tensor_bytes + bounce_bytes, f"peak grew by {grown} bytes for a {n * tensor_bytes}-byte model"
    assert validate_checkpoint(str(tmp_path / "hf"))
    # the measurement does see a load of everything
    assert _peak_growth(tmp_path, "load_all") > n * tensor_bytes // 2


def test_hf_to_distributed_takes_each_tensor_from_the_file_the_index_names(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    w, stale, v = torch.full((2, 2), 1.0), torch.full((2, 2), -9.0), torch.full((3,), 2.0)
    save_file({"w": w}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"v": v, "w": stale}, str(hf / "model-00002-of-00002.safetensors"))  # a stale copy of w
    (hf / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", '
        '"v": "model-00002-of-00002.safetensors"}}')
    hf_to_distributed(str(hf), str(tmp_path / "dist"))
    converted = load_distributed(str(tmp_path / "dist"), 0, 1)
    assert torch.equal(converted["w"], w) and torch.equal(converted["v"], v)
    assert torch.equal(load_checkpoint(str(hf), None)["w"], converted["w"])  # both readers agree


def test_a_source_damaged_past_its_headers_leaves_the_hf_checkpoint_untouched(tmp_path, monkeypatch):
    from shardkit.errors import IncompleteCheckpointError

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 4096)  # the damage lies in a block no header covers
    save_distributed({"w": torch.randn(8192)}, str(tmp_path / "good"), 0, 1, None)
    distributed_to_hf(str(tmp_path / "good"), str(tmp_path / "hf"))
    save_distributed({"w": torch.randn(8192)}, str(tmp_path / "bad"), 0, 1, None)
    data = tmp_path / "bad" / "rank_0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(IncompleteCheckpointError, match="Nothing in .* was touched"):
        distributed_to_hf(str(tmp_path / "bad"), str(tmp_path / "hf"))
    assert load_checkpoint(str(tmp_path / "hf"), None)["w"].equal(load_distributed(str(tmp_path / "good"), 0, 1)["w"])

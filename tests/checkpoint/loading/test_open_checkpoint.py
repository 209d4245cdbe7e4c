"""One read path: a checkpoint opened once serves many region reads (manifest once, each file once)."""

import torch

import shardkit.checkpoint as ckpt
import shardkit.checkpoint.loading.read_path as open_checkpoint_module
from shardkit.hf.convert import distributed_to_hf
from shardkit.storage.backends.local import LocalStorage

NAMES = [f"layer{i}.w" for i in range(6)]


def _save(path):
    spec = ckpt.ShardMetadata(2, {n: ckpt.TensorShardSpec((8, 3), 0, (4, 4)) for n in NAMES})
    full = {n: torch.arange(24.0).reshape(8, 3) + i for i, n in enumerate(NAMES)}
    for rank in range(2):
        ckpt.save_distributed({n: t[4 * rank: 4 * rank + 4] for n, t in full.items()}, path, rank, 2, spec)
    return full


def _data_files(paths) -> list[str]:
    """The data files among the opened paths, each as often as it was opened."""
    return sorted(p.rsplit("/", 1)[-1] for p in paths if p.endswith(".safetensors"))


def _count(monkeypatch):
    calls = {"manifest": 0, "opened": []}
    real_read, real_open = open_checkpoint_module.read_manifest, LocalStorage.open_reader

    def read(*args):
        calls["manifest"] += 1
        return real_read(*args)

    def open_reader(self, path):
        calls["opened"].append(path)
        return real_open(self, path)

    monkeypatch.setattr(open_checkpoint_module, "read_manifest", read)
    monkeypatch.setattr(LocalStorage, "open_reader", open_reader)
    return calls


def test_regions_of_an_open_checkpoint_share_one_manifest_and_one_open_per_file(tmp_path, monkeypatch):
    full = _save(str(tmp_path / "ck"))
    calls = _count(monkeypatch)
    with ckpt.open_checkpoint(str(tmp_path / "ck")) as source:
        for name in NAMES:
            assert torch.equal(source.region(name, (2, 0), (4, 3)), full[name][2:6])
    assert calls["manifest"] == 1
    assert _data_files(calls["opened"]) == ["rank_0.safetensors", "rank_1.safetensors"]


def test_distributed_to_hf_reads_through_one_open_checkpoint(tmp_path, monkeypatch):
    full = _save(str(tmp_path / "ck"))
    calls = _count(monkeypatch)
    distributed_to_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert calls["manifest"] == 1
    assert _data_files(p for p in calls["opened"] if "/ck/" in p) == ["rank_0.safetensors", "rank_1.safetensors"]
    from shardkit.hf import load_checkpoint

    loaded = load_checkpoint(str(tmp_path / "hf"))
    assert all(torch.equal(loaded[n], full[n]) for n in NAMES)

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_helpers import mixed_state
from shardkit.errors import MissingShardError, TensorMismatchError
from shardkit.hf import (
    index_file_name,
    load_checkpoint,
    load_shard_index,
    load_sharded_checkpoint,
    make_shard_index,
    save_checkpoint,
    save_shard_index,
    save_sharded_checkpoint,
)
from shardkit.storage import LocalStorage

@pytest.mark.parametrize("safetensors", [True, False])
def test_dict_mode_round_trip(tmp_path, safetensors):
    sd = mixed_state()
    save_checkpoint(str(tmp_path), sd, safetensors=safetensors, max_shard_size=200)
    out = load_checkpoint(str(tmp_path), None)
    assert sorted(out) == sorted(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k
    assert os.path.exists(tmp_path / index_file_name(safetensors))


def test_shards_are_plain_safetensors_with_format_pt(tmp_path):
    sd = mixed_state()
    save_checkpoint(str(tmp_path), sd, safetensors=True, max_shard_size=200)
    index = load_shard_index(str(tmp_path), index_file_name(True))
    for f in set(index["weight_map"].values()):
        from safetensors import safe_open

        with safe_open(str(tmp_path / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
        for name, t in load_file(str(tmp_path / f)).items():
            assert torch.equal(t, sd[name])


def test_max_shard_size_is_honoured(tmp_path):
    sd = {f"w{i}": torch.zeros(25) for i in range(10)}  # 100 bytes each
    sd["huge"] = torch.zeros(1000)
    save_checkpoint(str(tmp_path), sd, safetensors=True, max_shard_size=250)
    index = load_shard_index(str(tmp_path), index_file_name(True))
    files = set(index["weight_map"].values())
    for f in files:
        names = [n for n, ff in index["weight_map"].items() if ff == f]
        data = sum(sd[n].nbytes for n in names)
        assert data <= 250 or names == ["huge"]
    assert len(files) == 6


def test_keys_reads_only_the_shards_holding_them(tmp_path, monkeypatch):
    sd = {f"w{i}": torch.full((25,), float(i)) for i in range(8)}
    save_checkpoint(str(tmp_path), sd, safetensors=True, max_shard_size=100)
    index = load_shard_index(str(tmp_path), index_file_name(True))
    opened = []
    real = LocalStorage.open_reader
    monkeypatch.setattr(LocalStorage, "open_reader", lambda self, p: opened.append(os.path.basename(p)) or real(self, p))
    real_map = LocalStorage.map_private  # zero-copy loads (the default) map instead of opening a reader
    monkeypatch.setattr(LocalStorage, "map_private", lambda self, p: opened.append(os.path.basename(p)) or real_map(self, p))
    out = load_checkpoint(str(tmp_path), None, keys={"w3"})
    assert list(out) == ["w3"] and torch.equal(out["w3"], sd["w3"])
    assert set(opened) == {"model.safetensors.index.json", index["weight_map"]["w3"]}


def test_unknown_keys_are_a_typed_error(tmp_path):
    save_checkpoint(str(tmp_path), {"a": torch.zeros(1)}, safetensors=True)
    with pytest.raises(TensorMismatchError, match="not in the checkpoint"):
        load_checkpoint(str(tmp_path), None, keys={"nope"})


class Net(torch.nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        if extra:
            self.c = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.tensor(7))


def test_module_mode_reads_into_parameter_memory(tmp_path):
    torch.manual_seed(0)
    src = Net()
    save_checkpoint(str(tmp_path), src, safetensors=True, max_shard_size=100)
    dst = Net()
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    assert load_checkpoint(str(tmp_path), dst) is None
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]) and v.data_ptr() == ptrs[k]


def test_module_mode_casts_to_the_module_dtype(tmp_path):
    src = Net()
    save_checkpoint(str(tmp_path), src, safetensors=True)
    dst = Net().to(torch.float64)
    load_checkpoint(str(tmp_path), dst)
    assert dst.a.weight.dtype == torch.float64
    assert torch.equal(dst.a.weight, src.a.weight.double())


def test_strict_and_non_strict(tmp_path):
    save_checkpoint(str(tmp_path), Net(), safetensors=True)
    with pytest.raises(TensorMismatchError, match="missing .*c.weight"):
        load_checkpoint(str(tmp_path), Net(extra=True))
    index = load_shard_index(str(tmp_path), index_file_name(True))
    missing = load_sharded_checkpoint(str(tmp_path), index, Net(extra=True), safetensors=True, strict=False)
    assert missing == {"c.weight", "c.bias"}
    small = torch.nn.Module()
    small.a = torch.nn.Linear(8, 8)
    load_checkpoint(str(tmp_path), small)  # tensors the module lacks are not an error (a module may be a shard)
    load_checkpoint(str(tmp_path), small, strict=False)


def test_shape_mismatch_is_a_typed_error(tmp_path):
    save_checkpoint(str(tmp_path), {"a.weight": torch.zeros(3, 8), "a.bias": torch.zeros(3)}, safetensors=True)
    m = torch.nn.Module()
    m.a = torch.nn.Linear(8, 4)
    with pytest.raises(TensorMismatchError, match="shape"):
        load_checkpoint(str(tmp_path), m)


def test_assign_replaces_meta_parameters(tmp_path):
    src = Net()
    save_checkpoint(str(tmp_path), src, safetensors=True)
    with torch.device("meta"):
        dst = Net()
    load_checkpoint(str(tmp_path), dst, assign=True)
    assert dst.a.weight.device.type == "cpu" and isinstance(dst.a.weight, torch.nn.Parameter)
    assert torch.equal(dst.a.weight, src.a.weight)


def test_bin_module_mode(tmp_path):
    src = Net()
    save_checkpoint(str(tmp_path), src, safetensors=False, max_shard_size=100)
    dst = Net()
    load_checkpoint(str(tmp_path), dst)
    assert torch.equal(dst.b.weight, src.b.weight)


def test_each_rank_writes_only_its_shards(tmp_path):
    ranks = [{"r0.w": torch.randn(10), "r0.b": torch.randn(3)}, {"r1.w": torch.randn(20)}]
    index = make_shard_index(ranks, safetensors=True, max_shard_size=10**6)
    save_sharded_checkpoint(str(tmp_path), index, ranks[1], safetensors=True)
    assert sorted(os.listdir(tmp_path)) == ["model-00002-of-00002.safetensors"]
    save_sharded_checkpoint(str(tmp_path), index, ranks[0], safetensors=True)
    save_shard_index(index, str(tmp_path), index_file_name(True))
    out = load_checkpoint(str(tmp_path), None)
    for sd in ranks:
        for k, v in sd.items():
            assert torch.equal(out[k], v)


def test_a_split_shard_is_refused(tmp_path):
    index = make_shard_index([{"a": torch.zeros(2), "b": torch.zeros(2)}], safetensors=True)
    with pytest.raises(TensorMismatchError, match="one rank"):
        save_sharded_checkpoint(str(tmp_path), index, {"a": torch.zeros(2)}, safetensors=True)
    with pytest.raises(TensorMismatchError, match="not in the shard index"):
        save_sharded_checkpoint(str(tmp_path), index, {"a": torch.zeros(2), "b": torch.zeros(2), "z": torch.zeros(1)},
                                safetensors=True)


def test_non_tensor_values_are_refused(tmp_path):
    with pytest.raises(TensorMismatchError, match="only str -> torch.Tensor"):
        save_checkpoint(str(tmp_path), {"step": 3}, safetensors=True)


def test_resave_replaces_the_old_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path), {f"w{i}": torch.zeros(100) for i in range(5)}, safetensors=True, max_shard_size=400)
    save_checkpoint(str(tmp_path), {"x": torch.ones(3)}, safetensors=True)
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert list(load_checkpoint(str(tmp_path), None)) == ["x"]


def test_missing_checkpoint_and_missing_shard(tmp_path):
    with pytest.raises(MissingShardError, match="holds no Hugging Face checkpoint"):
        load_checkpoint(str(tmp_path), None)
    save_checkpoint(str(tmp_path), {"a": torch.zeros(100), "b": torch.zeros(100)}, safetensors=True, max_shard_size=400)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(MissingShardError, match="incomplete"):
        load_checkpoint(str(tmp_path), None)


def test_non_contiguous_and_view_tensors(tmp_path):
    base = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    sd = {"t": base.t(), "slice": base[2:4], "col": base[:, 3]}
    for safetensors in (True, False):
        save_checkpoint(str(tmp_path / str(safetensors)), sd, safetensors=safetensors)
        out = load_checkpoint(str(tmp_path / str(safetensors)), None)
        for k in sd:
            assert torch.equal(out[k], sd[k])


def test_index_metadata_is_kept(tmp_path):
    save_checkpoint(str(tmp_path), {"a": torch.zeros(1)}, metadata={"step": 5}, safetensors=True)
    meta = json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]
    assert meta == {"total_size": 4, "step": 5}


def test_bad_arguments_are_typed_errors(tmp_path):
    from shardkit.errors import MetadataError
    from shardkit.hf import maybe_delete_oldest_checkpoint

    with pytest.raises(MetadataError, match="max_shard_size"):
        save_checkpoint(str(tmp_path), {"a": torch.zeros(1)}, safetensors=True, max_shard_size=0)
    save_checkpoint(str(tmp_path), {"a": torch.zeros(1)}, safetensors=True)
    with pytest.raises(TensorMismatchError, match="nn.Module"):
        load_checkpoint(str(tmp_path), {"a": torch.zeros(1)})
    with pytest.raises(MetadataError, match="max_checkpoints"):
        maybe_delete_oldest_checkpoint(str(tmp_path), -1)


@pytest.mark.parametrize("safetensors", [True, False])
def test_sync_files_false_skips_every_fsync_and_still_publishes_atomically(tmp_path, monkeypatch, safetensors):
    import shardkit.storage.backends.atomic as atomic

    synced = []
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(atomic, "start_writeback", lambda *a: synced.append(a))
    sd = mixed_state()
    save_checkpoint(str(tmp_path), sd, safetensors=safetensors, max_shard_size=300, sync_files=False)
    assert synced == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary file left behind
    out = load_checkpoint(str(tmp_path), None)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    save_checkpoint(str(tmp_path), sd, safetensors=safetensors, max_shard_size=300)  # the default syncs
    assert synced

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.hf import index_file_name, load_shard_index, make_shard_index, save_shard_index
from shardkit.hf.index import plan_shards


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 120))
def test_plan_shards_respects_limit_and_order(sizes, limit):
    names = [(f"t{i}", n) for i, n in enumerate(sizes)]
    plan = plan_shards(names, limit)
    assert [n for shard in plan for n in shard] == [n for n, _ in names]
    size = dict(names)
    for shard in plan:
        assert shard
        assert sum(size[n] for n in shard) <= limit or len(shard) == 1
    # greedy: a shard could not have taken the first tensor of the next one
    for a, b in zip(plan, plan[1:]):
        assert sum(size[n] for n in a) + size[b[0]] > limit


def test_make_shard_index_names_and_total():
    sd = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(3, dtype=torch.float64)}
    index = make_shard_index([sd], metadata={"step": 3}, safetensors=True, max_shard_size=64)
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"] == {"total_size": 104, "step": 3}


def test_each_state_dict_gets_its_own_files():
    index = make_shard_index([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], max_shard_size=10**6)
    assert index["weight_map"] == {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}


def test_aliases_are_left_out_and_recorded():
    w = torch.zeros(4)
    index = make_shard_index([{"emb": w, "head": w, "x": torch.ones(2)}], safetensors=True)
    assert set(index["weight_map"]) == {"emb", "x"}
    assert index["metadata"]["param_sharing"] == [["emb", "head"]]
    assert index["metadata"]["total_size"] == 24


def test_index_round_trip(tmp_path):
    index = make_shard_index([{"a": torch.zeros(2)}], safetensors=True)
    save_shard_index(index, str(tmp_path), index_file_name(True))
    assert load_shard_index(str(tmp_path), index_file_name(True)) == index
    assert index_file_name(False) == "pytorch_model.bin.index.json"


@pytest.mark.parametrize("bad", ["/etc/passwd.safetensors", "../x.safetensors", "a/../../b.safetensors",
                                 "model.bin", "model.safetensors.json", "C:\\x.safetensors", ""])
def test_bad_file_names_are_refused(tmp_path, bad):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": bad}}))
    with pytest.raises(MetadataError) as e:
        load_shard_index(str(tmp_path), "model.safetensors.index.json")
    assert "only plain relative names" in str(e.value) or "non-empty" in str(e.value)


def test_bad_index_shapes_are_refused(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    for text, words in [("{not json", "not valid JSON"), ("[1]", "weight_map"),
                        ('{"weight_map": {}, "metadata": {"param_sharing": [["a"]]}}', "param_sharing"),
                        # a name in two groups: dict mode and module mode gave it different tensors
                        ('{"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}, '
                         '"metadata": {"param_sharing": [["a", "b"], ["b", "a"]]}}', "names 'b' twice")]:
        p.write_text(text)
        with pytest.raises(MetadataError, match=words):
            load_shard_index(str(tmp_path), p.name)


def test_oversized_index_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(json.dumps({"weight_map": {f"w{i}": "model.safetensors" for i in range(2000)}}))
    monkeypatch.setattr(knobs, "MAX_INDEX_BYTES", 1024)
    with pytest.raises(MetadataError, match="over the limit of 1024"):
        load_shard_index(str(tmp_path), p.name)


def test_default_index_limit_is_10_mib(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    with open(p, "w") as f:
        f.write('{"weight_map": {}, "metadata": {"pad": "' + "x" * (10 * 1024 * 1024) + '"}}')
    with pytest.raises(MetadataError, match="over the limit"):
        load_shard_index(str(tmp_path), p.name)

"""forgather's sharded_checkpoint behaviours that users rely on (issue 14).

Each test names the behaviour of forgather (or transformers) it pins down;
every one of them failed on shardkit before the fix that came with it.
"""

import json
import os
import warnings

import pytest
import torch
from hf_helpers import Tied, tiny_llama
from safetensors.torch import load_file

from shardkit.errors import CheckpointError, MetadataError, MissingShardError, TensorMismatchError
from shardkit.hf import (
    create_pretrained_symlinks,
    index_file_name,
    load_checkpoint,
    load_checkpoint_metrics,
    load_shard_index,
    load_sharded_checkpoint,
    make_shard_index,
    next_checkpoint_path,
    retie_parameters,
    save_checkpoint,
    save_checkpoint_metrics,
    save_shard_index,
    save_sharded_checkpoint,
)


class Stage0(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.body = torch.nn.Linear(8, 8)


class Stage1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 20, bias=False)


# 1. a checkpoint that leaves out a tied weight, loaded with assign=True


@pytest.mark.parametrize("on_meta", [False, True])
def test_assign_load_ties_a_weight_the_checkpoint_left_out(tmp_path, on_meta):
    src = tiny_llama(tied=True)
    src.save_pretrained(str(tmp_path))  # transformers stores embed_tokens only
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    if on_meta:
        with torch.device("meta"):
            dst = tiny_llama(tied=True, seed=3)
    else:
        dst = tiny_llama(tied=True, seed=3)
    load_checkpoint(str(tmp_path), dst, strict=True, assign=True)
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight)


def test_assign_load_ties_a_plain_module_weight_left_out(tmp_path):
    src = Tied()
    sd = {k: v for k, v in src.state_dict().items() if k != "head.weight"}
    save_checkpoint(str(tmp_path), sd, safetensors=True)
    dst = Tied()
    load_checkpoint(str(tmp_path), dst, strict=True, assign=True)
    assert dst.head.weight is dst.emb.weight and torch.equal(dst.head.weight, src.emb.weight)


# 2. metrics into a directory that does not exist yet


def test_save_checkpoint_metrics_creates_the_directory(tmp_path):
    path = str(tmp_path / "checkpoints" / "checkpoint-7")
    save_checkpoint_metrics(path, {"eval_loss": 1.25})
    assert load_checkpoint_metrics(path) == {"eval_loss": 1.25}


# 3. the seed's multi-GPU example: one index for all shards, strict=True


def _save_stages(out, stages, sharing=None):
    index = make_shard_index([s.state_dict() for s in stages], safetensors=True, param_sharing_metadata=sharing)
    save_shard_index(index, out, index_file_name(True))
    for stage in stages:
        save_sharded_checkpoint(out, index, stage, safetensors=True)


def test_module_shard_loads_from_the_full_index_with_strict(tmp_path):
    out = str(tmp_path)
    torch.manual_seed(0)
    stages = [Stage0(), Stage1()]
    _save_stages(out, stages)
    index = load_shard_index(out, index_file_name(True))
    for src, fresh in zip(stages, [Stage0(), Stage1()]):
        fresh.to_empty(device="cpu")
        assert load_sharded_checkpoint(out, index, fresh, device="cpu", safetensors=True) == set()
        for k, v in src.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
    whole = load_sharded_checkpoint(out, index, module=None, device="cpu", safetensors=True)
    assert sorted(whole) == ["body.bias", "body.weight", "emb.weight", "head.weight"]


def test_module_key_the_index_lacks_is_still_an_error(tmp_path):
    out = str(tmp_path)
    _save_stages(out, [Stage0()])
    index = load_shard_index(out, index_file_name(True))
    with pytest.raises(TensorMismatchError, match="head.weight"):
        load_sharded_checkpoint(out, index, Stage1(), safetensors=True)


def test_stage_holding_only_the_tied_alias_loads_it(tmp_path):
    """A pipeline stage owns ``head.weight``, stored once under its tie ``emb.weight`` by another stage."""
    out = str(tmp_path)
    torch.manual_seed(0)
    stages = [Stage0(), Stage1()]
    stages[1].head.weight = torch.nn.Parameter(stages[0].emb.weight.detach().clone())
    _save_stages(out, stages, sharing=[["emb.weight", "head.weight"]])
    index = load_shard_index(out, index_file_name(True))
    assert "head.weight" not in index["weight_map"]
    last = Stage1()
    assert load_sharded_checkpoint(out, index, last, safetensors=True) == set()
    assert torch.equal(last.head.weight, stages[0].emb.weight)


# 4. make_shard_index with sharing groups whose names are not in the state dicts


def test_make_shard_index_warns_about_sharing_names_it_cannot_find():
    sd = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.zeros(2)}
    with pytest.warns(UserWarning, match="ghost"):
        index = make_shard_index([sd], param_sharing_metadata=[["a", "b"], ["c", "ghost"]])
    assert index["metadata"]["param_sharing"] == [["a", "b"]]
    assert sorted(index["weight_map"]) == ["a", "c"]


def test_make_shard_index_never_drops_a_tensor_whose_group_source_is_absent():
    sd = {"a": torch.ones(3), "b": torch.ones(3)}
    with pytest.warns(UserWarning, match="x"):
        index = make_shard_index([sd], param_sharing_metadata=[["x", "a", "b"]])
    assert index["weight_map"] == {"a": "pytorch_model-00001-of-00001.bin"}
    assert index["metadata"]["param_sharing"] == [["a", "b"]]


def test_make_shard_index_is_quiet_when_every_name_is_there():
    sd = {"a": torch.ones(3), "b": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_shard_index([{"a": sd["a"]}, {"b": sd["b"]}], param_sharing_metadata=[["a", "b"]])


# 5. retie_parameters on a module that lacks the tied names


def test_retie_parameters_skips_names_the_module_lacks():
    stage = Stage0()
    before = stage.emb.weight
    retie_parameters(stage, [["lm.embed.weight", "lm.head.weight"]])  # no name here
    retie_parameters(stage, [["emb.weight", "head.weight"]])  # one name here
    assert stage.emb.weight is before
    whole = Tied()
    whole.head.weight = torch.nn.Parameter(torch.zeros(50, 16))
    retie_parameters(whole, [["ghost.weight", "emb.weight", "head.weight"]])
    assert whole.head.weight is whole.emb.weight


# 6. save_checkpoint of a transformers model writes what from_pretrained needs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_checkpoint_of_a_transformers_model_loads_with_from_pretrained(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    src = tiny_llama(tied=True).to(dtype).eval()
    before = src.config.to_dict()
    save_checkpoint(str(tmp_path), src, safetensors=True, max_shard_size=20_000)
    assert src.config.to_dict() == before  # the model's own config is not modified
    assert (tmp_path / "config.json").exists() and (tmp_path / "generation_config.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert loaded.dtype == dtype
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, src(ids).logits)


def test_save_checkpoint_writes_no_config_for_plain_modules_and_dicts(tmp_path):
    save_checkpoint(str(tmp_path / "m"), Tied(), safetensors=True)
    save_checkpoint(str(tmp_path / "d"), {"w": torch.ones(2)}, safetensors=True)
    for d in ("m", "d"):
        assert not (tmp_path / d / "config.json").exists()
        assert not (tmp_path / d / "generation_config.json").exists()


# 7. max_shard_size as a string


@pytest.mark.parametrize("size", ["5GB", "500MB", "2GiB", "20KB", "20kb", "3MiB", "1KiB", "8Mb", 12_345])
def test_max_shard_size_accepts_transformers_strings(size):
    from transformers.utils.hub import convert_file_size_to_int

    from shardkit.hf.index import shard_size_bytes

    assert shard_size_bytes(size) == convert_file_size_to_int(size)


def test_save_checkpoint_splits_by_a_string_size(tmp_path):
    sd = {f"w{i}": torch.zeros(2500) for i in range(4)}  # 10 kB each
    save_checkpoint(str(tmp_path / "s"), sd, safetensors=True, max_shard_size="20KB")
    save_checkpoint(str(tmp_path / "i"), sd, safetensors=True, max_shard_size=20_000)
    by_string = load_shard_index(str(tmp_path / "s"), index_file_name(True))
    by_int = load_shard_index(str(tmp_path / "i"), index_file_name(True))
    assert by_string["weight_map"] == by_int["weight_map"] and len(set(by_int["weight_map"].values())) == 2
    assert make_shard_index([sd], max_shard_size="1GiB")["weight_map"] == make_shard_index([sd], max_shard_size=2**30)[
        "weight_map"
    ]


@pytest.mark.parametrize("bad", ["5 parsecs", "GB", "1.5GB", True, 2.0, None])
def test_max_shard_size_refuses_what_transformers_refuses(bad):
    with pytest.raises(MetadataError, match="max_shard_size"):
        make_shard_index([{"w": torch.zeros(2)}], max_shard_size=bad)


# 8. create_pretrained_symlinks says why it made no links


def test_symlinks_without_a_checkpoint_raise_file_not_found(tmp_path):
    with pytest.raises(MissingShardError, match="no complete checkpoint") as e:
        create_pretrained_symlinks(str(tmp_path))
    assert isinstance(e.value, FileNotFoundError)


@pytest.mark.parametrize("dry_run", [False, True])
def test_symlinks_refuse_a_real_file_in_the_way(tmp_path, dry_run):
    save_checkpoint(next_checkpoint_path(str(tmp_path), 1), {"w": torch.ones(4)}, safetensors=True)
    (tmp_path / "model.safetensors.index.json").write_text("mine")
    with pytest.raises(FileExistsError, match="force_overwrite") as e:
        create_pretrained_symlinks(str(tmp_path), dry_run=dry_run)
    assert isinstance(e.value, CheckpointError)
    assert (tmp_path / "model.safetensors.index.json").read_text() == "mine"
    assert [p for p in os.listdir(tmp_path) if os.path.islink(tmp_path / p)] == []  # nothing half-done
    links = create_pretrained_symlinks(str(tmp_path), force_overwrite=True, dry_run=dry_run)
    assert len(links) == 2 and os.path.islink(tmp_path / "model.safetensors.index.json") != dry_run

"""Tied parameters and interop with transformers / huggingface_hub, both ways (tiny models, no downloads)."""

import json
import os

import pytest
import torch
from hf_helpers import Tied, assert_same_state, tiny_llama, tiny_llama_config
from safetensors.torch import load_file

from shardkit.hf import (
    create_sharing_metadata,
    index_file_name,
    load_checkpoint,
    load_shard_index,
    retie_parameters,
    save_checkpoint,
)


def test_sharing_metadata_finds_the_tie(tied_model):
    assert create_sharing_metadata(tied_model) == [["emb.weight", "head.weight"]]


def test_tied_model_saves_one_copy_and_reties(tmp_path, tied_model):
    save_checkpoint(str(tmp_path), tied_model, safetensors=True)
    index = load_shard_index(str(tmp_path), index_file_name(True))
    assert index["metadata"]["param_sharing"] == [["emb.weight", "head.weight"]]
    assert "head.weight" not in index["weight_map"]
    on_disk = load_file(str(tmp_path / "model-00001-of-00001.safetensors"))
    assert "head.weight" not in on_disk
    fresh = Tied()
    fresh.head.weight = torch.nn.Parameter(torch.zeros(50, 16))  # untied, as after some conversions
    load_checkpoint(str(tmp_path), fresh)
    assert fresh.head.weight is fresh.emb.weight
    assert_same_state(fresh, tied_model)


def test_tied_dict_mode_returns_both_names_on_one_tensor(tmp_path, tied_model):
    save_checkpoint(str(tmp_path), tied_model, safetensors=True)
    sd = load_checkpoint(str(tmp_path), None)
    assert sd["head.weight"] is sd["emb.weight"]
    only = load_checkpoint(str(tmp_path), None, keys={"head.weight"})
    assert list(only) == ["head.weight"] and torch.equal(only["head.weight"], tied_model.emb.weight)


def test_explicit_sharing_and_opt_out(tmp_path, tied_model):
    save_checkpoint(str(tmp_path / "a"), tied_model, safetensors=True, include_param_sharing=False)
    assert "head.weight" in load_file(str(tmp_path / "a" / "model-00001-of-00001.safetensors"))
    sd = dict(tied_model.state_dict())
    save_checkpoint(str(tmp_path / "b"), sd, safetensors=True, param_sharing_metadata=[["emb.weight", "head.weight"]])
    m = Tied()
    load_checkpoint(str(tmp_path / "b"), m)
    assert m.head.weight is m.emb.weight


def test_retie_parameters_on_untied_module(tied_model):
    m = Tied()
    m.head.weight = torch.nn.Parameter(torch.zeros(50, 16))
    retie_parameters(m, [["emb.weight", "head.weight"]])
    assert m.head.weight is m.emb.weight


def _save_with_config(model, path, **kw):
    save_checkpoint(str(path), model, safetensors=True, **kw)
    model.config.save_pretrained(str(path))


def test_shardkit_to_transformers_from_pretrained_keeps_tie(tmp_path):
    from transformers import LlamaForCausalLM

    src = tiny_llama(tied=True)
    _save_with_config(src, tmp_path, max_shard_size=20_000)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert_same_state(loaded, src)


def test_shardkit_untied_to_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    src = tiny_llama(tied=False)
    _save_with_config(src, tmp_path, max_shard_size=20_000)
    assert_same_state(LlamaForCausalLM.from_pretrained(str(tmp_path)), src)


@pytest.mark.parametrize("tied", [True, False])
def test_shardkit_to_huggingface_hub_load_torch_model(tmp_path, tied):
    from huggingface_hub import load_torch_model

    src = tiny_llama(tied=tied)
    save_checkpoint(str(tmp_path), src, safetensors=True, max_shard_size=20_000)
    dst = tiny_llama(tied=tied, seed=5)
    # A tied model's second name is not stored (as with save_pretrained), which
    # load_torch_model's strict=True cannot know; its default strict=False loads it.
    load_torch_model(dst, str(tmp_path), strict=not tied)
    assert_same_state(dst, src)
    if tied:
        assert dst.lm_head.weight is dst.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False])
def test_save_pretrained_to_shardkit(tmp_path, tied):
    src = tiny_llama(tied=tied)
    src.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    dst = tiny_llama(tied=tied, seed=7)
    load_checkpoint(str(tmp_path), dst)
    assert_same_state(dst, src)
    if tied:
        assert dst.lm_head.weight is dst.model.embed_tokens.weight


def test_save_pretrained_single_file_to_shardkit(tmp_path):
    src = tiny_llama(tied=False)
    src.save_pretrained(str(tmp_path))
    assert os.path.exists(tmp_path / "model.safetensors")
    sd = load_checkpoint(str(tmp_path), None)
    assert_same_state(sd, src.state_dict())


def test_huggingface_hub_save_torch_state_dict_to_shardkit(tmp_path):
    from huggingface_hub import save_torch_state_dict

    sd = {f"layer.{i}.w": torch.randn(40, 40, dtype=torch.bfloat16) for i in range(6)}
    save_torch_state_dict(sd, str(tmp_path), max_shard_size=8000)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert_same_state(load_checkpoint(str(tmp_path), None), sd)


def test_huggingface_hub_bin_to_shardkit(tmp_path):
    from huggingface_hub import save_torch_state_dict

    sd = {f"w{i}": torch.randn(30) for i in range(4)}
    save_torch_state_dict(sd, str(tmp_path), max_shard_size=300, safe_serialization=False)
    assert_same_state(load_checkpoint(str(tmp_path), None), sd)


def test_transformers_config_unchanged_by_tiny_helper():
    assert tiny_llama_config(True).tie_word_embeddings

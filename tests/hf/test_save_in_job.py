"""``shardkit.hf.save_checkpoint`` inside a job: a collective over real Gloo ranks when the state holds DTensors.

Every rank writes the whole tensors assigned to it (gathered from the ranks
holding their parts), rank 0 the index last; ``dtype=`` casts on the way
out; the config comes from the module, so ``from_pretrained`` loads the
result, here with the same logits as the FSDP2 model's own weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from job_save_jobs import mixed_full, save_failing_on_rank_1, save_fsdp_llama, save_mismatched, save_mixed
from ranks import run_ranks
from shardkit.errors import TensorMismatchError
from shardkit.hf import load_checkpoint, load_shard_index, save_checkpoint, validate_checkpoint

pytestmark = pytest.mark.multiproc

INDEX = "model.safetensors.index.json"


def _saved(tmp_path, out: str, world_size: int, tied: bool, as_dict: bool) -> dict:
    """Run the save on ``world_size`` ranks; the model's full weights, as rank 0 had them."""
    from safetensors.torch import load_file

    run_ranks(save_fsdp_llama, world_size, tmp_path, out, tied, as_dict)
    return load_file(out + ".reference.safetensors")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _reference(full: dict, tied: bool, where: str):
    """The full weights, bf16, through transformers' own save_pretrained / from_pretrained."""
    from transformers import AutoModelForCausalLM

    from hf_helpers import tiny_llama

    ref = tiny_llama(tied=tied, seed=99)
    ref.load_state_dict(full)
    ref.to(torch.bfloat16).save_pretrained(where)
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16)


@pytest.mark.parametrize("tied, as_dict", [(True, False), (False, True)])
def test_an_fsdp2_llama_saved_from_every_rank_loads_in_from_pretrained_with_equal_logits(tmp_path, tied, as_dict):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    full = _saved(tmp_path, out, 2, tied, as_dict)
    assert validate_checkpoint(out)
    index = load_shard_index(out, INDEX)
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # one per rank
    for name in files:
        with safe_open(os.path.join(out, name), "pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    if tied:  # saved once, recorded as a tie
        assert "lm_head.weight" not in index["weight_map"]
        assert index["metadata"]["param_sharing"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    else:
        assert "lm_head.weight" in index["weight_map"] and "param_sharing" not in index["metadata"]
    if not as_dict:  # the module's config and generation config, as save_pretrained writes them
        config = json.loads(open(os.path.join(out, "config.json")).read())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
        assert os.path.exists(os.path.join(out, "generation_config.json"))
    else:  # a dict has no config: give from_pretrained one
        from hf_helpers import tiny_llama_config

        tiny_llama_config(tied).save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, full[name].to(torch.bfloat16)), name
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(loaded, ids), _logits(_reference(full, tied, str(tmp_path / "ref")), ids))


@pytest.mark.parametrize("safetensors", [True, False])
def test_shard_replicate_and_plain_parts_are_assembled_and_cast(tmp_path, safetensors):
    out = str(tmp_path / "mixed")
    assert run_ranks(save_mixed, 2, tmp_path, out, 60, safetensors) == [True, True]
    loaded = load_checkpoint(out)
    full = mixed_full()
    assert set(loaded) == set(full)
    for name, t in full.items():
        want = t.to(torch.float16) if t.is_floating_point() else t
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    files = set(load_shard_index(out, INDEX if safetensors else "pytorch_model.bin.index.json")["weight_map"].values())
    assert len(files) > 2  # a small max_shard_size: several files per rank


def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank_and_no_index_appears(tmp_path):
    out = str(tmp_path / "hf")
    results = run_ranks(save_failing_on_rank_1, 2, tmp_path, out)
    assert results[1][0] == "OSError"
    assert results[0][0] == "CheckpointError" and "rank 1" in results[0][1] and "No space left" in results[0][1]
    assert not os.path.exists(os.path.join(out, INDEX)) and not validate_checkpoint(out)


def test_ranks_that_would_save_different_states_all_refuse_and_keep_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "hf")
    save_checkpoint(out, {"old": torch.ones(3)}, safetensors=True)
    results = run_ranks(save_mismatched, 2, tmp_path, out)
    assert [kind for kind, _ in results] == [TensorMismatchError.__name__] * 2
    assert "rank 1" in results[0][1] and "collective" in results[0][1]
    assert torch.equal(load_checkpoint(out)["old"], torch.ones(3))


def test_an_fsdp2_module_in_one_process_saves(tmp_path):
    """A mesh of one: no peer, the same code path (the issue's data_ptr RuntimeError)."""
    out = str(tmp_path / "one")
    full = _saved(tmp_path, out, 1, True, False)
    assert "lm_head.weight" not in load_shard_index(out, INDEX)["weight_map"]  # stored once, under its tie
    loaded = load_checkpoint(out)
    assert set(loaded) == set(full)
    assert all(torch.equal(loaded[n], full[n].to(torch.bfloat16)) for n in loaded)

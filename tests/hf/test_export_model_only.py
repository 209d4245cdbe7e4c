"""Exporting a training checkpoint (model + optimizer + rank_state) as Hugging Face: the model tensors only.

``shardkit convert --to hf`` and ``distributed_to_hf`` go through the one
HF writer; by default neither exports optimizer moments or ``__rank_state__``,
and ``from_pretrained`` then reports no unexpected (nor missing) keys.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from hf_helpers import tiny_llama, tiny_llama_config
import shardkit.checkpoint as ckpt
from shardkit.hf import distributed_to_hf, load_checkpoint, load_shard_index

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A saved training state of a tiny untied Llama after one AdamW step, with per-rank RNG state."""
    root = tmp_path_factory.mktemp("train")
    model = tiny_llama(tied=False, seed=4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}
    ckpt.save(state, str(root / "ckpt"), rank_state={"torch": torch.get_rng_state()})
    config = root / "config.json"
    config.write_text(tiny_llama_config(tied=False).to_json_string())
    return model, str(root / "ckpt"), str(config)


def _cli(*argv) -> int:
    from shardkit.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main([str(a) for a in argv])


def _loads_cleanly(model, out: str, dtype) -> None:
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, output_loading_info=True)
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["missing_keys"], info["missing_keys"]
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, model.state_dict()[name].to(dtype)), name


def test_convert_to_hf_exports_the_model_tensors_only(trained, tmp_path):
    model, src, config = trained
    with ckpt.open_checkpoint(src) as source:  # the source holds optimizer moments and per-rank state
        names = set(source.manifest.tensors)
    assert any(n.startswith("optim.") for n in names) and any(n.startswith("__rank_state__") for n in names)
    out = tmp_path / "hf"
    assert _cli("convert", src, out, "--to", "hf", "--dtype", "bf16", "--config", config, "-q") == 0
    assert set(load_shard_index(str(out), INDEX)["weight_map"]) == set(model.state_dict())
    _loads_cleanly(model, str(out), torch.bfloat16)


def test_convert_to_hf_with_an_empty_prefix_still_exports_everything(trained, tmp_path):
    _, src, _ = trained
    out = tmp_path / "all"
    assert _cli("convert", src, out, "--to", "hf", "--prefix", "", "-q") == 0
    names = set(load_shard_index(str(out), INDEX)["weight_map"])
    assert any(n.startswith("optim.") for n in names) and any(n.startswith("__rank_state__") for n in names)


def test_distributed_to_hf_is_the_same_export(trained, tmp_path):
    model, src, config = trained
    out = str(tmp_path / "hf")
    distributed_to_hf(src, out, dtype=torch.float16, config=config, max_shard_size=40_000)
    index = load_shard_index(out, INDEX)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert len(set(index["weight_map"].values())) > 1
    assert "shardkit_objects" not in index["metadata"]  # the step is training state, left out with the optimizer
    assert os.path.exists(os.path.join(out, "config.json"))
    _loads_cleanly(model, out, torch.float16)
    loaded = load_checkpoint(out)
    assert {t.dtype for t in loaded.values()} == {torch.float16}

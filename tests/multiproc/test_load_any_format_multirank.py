"""``shardkit.checkpoint.load`` on real Gloo ranks: Hugging Face and DCP checkpoints into FSDP2 state.

Oracles: ``from_pretrained`` (the weights a bf16 checkpoint gives an fp32
model) and ``dcp.load`` (the same state loaded by DCP). Each rank also counts
the bytes it reads: exactly its own shards' bytes of the safetensors data.
"""

from __future__ import annotations

import os

import pytest
import torch

from load_any_jobs import dcp_load_compare_job, dcp_save_job, hf_into_fsdp2_job, hf_load_checkpoint_fsdp2_job
from ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _save_llama(path, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("world_size", [2, 3])
def test_hf_bf16_into_fsdp2_fp32_with_cast_equals_from_pretrained(tmp_path, world_size):
    hf_dir = _save_llama(tmp_path / "hf", torch.bfloat16)
    results = run_ranks(hf_into_fsdp2_job, world_size, tmp_path, hf_dir)
    for mismatched, data_read, own_bytes, data_bytes in results:
        assert mismatched == []
        assert data_read == own_bytes < data_bytes     # only this rank's shards, the tied weight once
    assert sum(r[1] for r in results) == results[0][3]   # together, every byte of the data once


def test_hf_load_checkpoint_fills_an_fsdp2_module(tmp_path):
    hf_dir = _save_llama(tmp_path / "hf", torch.float32)
    assert run_ranks(hf_load_checkpoint_fsdp2_job, 2, tmp_path, hf_dir) == [[], []]


def test_dcp_saved_on_2_ranks_loads_on_1_and_3_like_dcp_load(tmp_path):
    run_ranks(dcp_save_job, 2, tmp_path, str(tmp_path))
    for world_size in (1, 3):
        for mismatched, changed, our_step, their_step, same_groups in run_ranks(
                dcp_load_compare_job, world_size, tmp_path, str(tmp_path)):
            assert mismatched == [] and changed >= 4
            assert our_step == their_step == 1 and same_groups

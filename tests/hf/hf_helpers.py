"""Shared helpers for the shardkit.hf tests: tiny models built from configs (nothing downloaded)."""
import os

import torch

# Nothing in these tests may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tiny_llama_config(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )


def tiny_llama(tied: bool = True, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tied))


def assert_same_state(a, b):
    sa, sb = a.state_dict() if hasattr(a, "state_dict") else a, b.state_dict() if hasattr(b, "state_dict") else b
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


class Tied(torch.nn.Module):
    """Small model with a tied embedding/head, a buffer and a bias."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))



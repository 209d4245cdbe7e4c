"""Shared helpers for the shardkit.hf tests: tiny models built from configs (nothing downloaded)."""
import os

import torch

# Nothing in these tests may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


#: Every dtype torch and safetensors share, for round-trip tests.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.uint8, torch.float8_e4m3fn]


def mixed_state() -> dict:
    """One small tensor of each dtype, a 0-d tensor, a 0-size tensor and a 64x64 float32."""
    torch.manual_seed(0)
    sd = {f"t.{i}.{str(d).split('.')[-1]}": (torch.randn(3, 5) * 10).to(d) for i, d in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4)
    sd["big"] = torch.randn(64, 64)
    return sd


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



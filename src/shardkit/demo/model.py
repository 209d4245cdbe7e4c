"""The demo's model and data: a tiny Llama built in code, and one batch per step.

Nothing is downloaded: :func:`llama_config` is a ``transformers`` ``LlamaConfig``
written here (about 1M parameters), and the "text" is a synthetic token stream
with structure to learn (each token mostly follows from the one before).
:func:`batch_for_step` depends only on the step, so every rank, on any world
size, trains on the same batch at the same step: the math of a step does not
depend on how many ranks run it. Not a benchmark of anything.

Example::

    model = build_model(seed=0)
    loss = train_step(model, torch.optim.Adam(model.parameters(), lr=LR), step=0)
"""

from __future__ import annotations

import torch

VOCAB = 256
SEQ_LEN = 32
BATCH = 16
LR = 5e-3
SEED = 0


def llama_config():
    """The tiny model's config (4 layers, hidden 128, untied embeddings: ~1.05M parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                       tie_word_embeddings=False, use_cache=False)


def build_model(seed: int = SEED):
    """A fresh ``LlamaForCausalLM``; the same weights for the same seed, on every rank."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def batch_for_step(step: int, batch: int = BATCH, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids ``(batch, seq_len)`` for ``step``: 90% of tokens are ``(5 * prev + 3) % vocab``, the rest random."""
    g = torch.Generator().manual_seed(10_000 + step)
    noise = torch.randint(0, vocab, (batch, seq_len), generator=g)
    keep = torch.rand(batch, seq_len, generator=g) < 0.9
    tokens = noise.clone()
    for i in range(1, seq_len):
        tokens[:, i] = torch.where(keep[:, i], (5 * tokens[:, i - 1] + 3) % vocab, noise[:, i])
    return tokens


def probe_batch() -> torch.Tensor:
    """The batch whose logits are compared after the export (never trained on)."""
    return batch_for_step(-1, batch=2)


def train_step(model, optim, step: int) -> float:
    """One Adam step on :func:`batch_for_step`; returns the loss (a float32 value as a Python float)."""
    tokens = batch_for_step(step)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())

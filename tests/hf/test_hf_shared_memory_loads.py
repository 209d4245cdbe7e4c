"""Module loads into tensors that share memory: read once or one after the other, never mixed by parallel reads.

A checkpoint saved from an untied model holds both names of a tie with
different values. Loaded into a tied model, the two reads went into one
memory at once, chunk by chunk: the result was a mix of both tensors.
"""

import pytest
import torch
from hf_helpers import Tied

from shardkit import knobs
from shardkit.errors import TensorMismatchError
from shardkit.hf import load_checkpoint, save_checkpoint
from shardkit.hf.shard_io import read_shard_into
from shardkit.storage import storage_for


@pytest.fixture
def untied_checkpoint(tmp_path):
    """emb.weight and head.weight saved as two different tensors (an untied model's checkpoint)."""
    torch.manual_seed(0)
    state = {n: t.clone() for n, t in Tied().state_dict().items()}
    state["head.weight"] = torch.randn(50, 16)
    save_checkpoint(str(tmp_path), state, safetensors=True, include_param_sharing=False)
    return str(tmp_path), state


@pytest.mark.parametrize("assign", [False, True])
def test_a_tied_model_takes_the_first_name_of_the_tie_whole(untied_checkpoint, monkeypatch, assign):
    path, state = untied_checkpoint
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 64)  # many small reads per tensor: a race would show
    for _ in range(3):
        model = Tied()
        load_checkpoint(path, model, assign=assign)
        assert model.head.weight is model.emb.weight
        assert torch.equal(model.emb.weight, state["emb.weight"])  # as transformers' tie_weights: the embedding
        assert torch.equal(model.body.weight, state["body.weight"])


class _Overlapping(torch.nn.Module):
    """A buffer that is a slice of a parameter: the two must be filled one after the other."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64))
        self.register_buffer("w_head", self.w.data[:16])


def test_overlapping_tensors_load_as_load_state_dict_does(tmp_path, monkeypatch):
    state = {"w": torch.arange(64.0) + 100, "w_head": -torch.arange(16.0)}
    save_checkpoint(str(tmp_path), state, safetensors=True)
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 16)
    model, reference = _Overlapping(), _Overlapping()
    load_checkpoint(str(tmp_path), model)
    reference.load_state_dict(state)
    assert torch.equal(model.w, reference.w) and torch.equal(model.w_head, reference.w_head)
    assert model.w_head.data_ptr() == model.w.data_ptr()  # still a view: loaded in place, not replaced


def test_an_empty_tensor_of_another_shape_is_a_mismatch(tmp_path):
    save_checkpoint(str(tmp_path), {"e": torch.empty(0, 5)}, safetensors=True)
    model = torch.nn.Module()
    model.register_buffer("e", torch.empty(0, 4))
    with pytest.raises(TensorMismatchError, match="shape"):
        load_checkpoint(str(tmp_path), model)


def test_read_shard_into_refuses_targets_over_one_memory(untied_checkpoint):
    path, _ = untied_checkpoint
    store, root = storage_for(path)
    w = torch.zeros(50, 16)
    with pytest.raises(TensorMismatchError, match="same memory"):
        read_shard_into(store, store.join(root, "model-00001-of-00001.safetensors"),
                        {"emb.weight": w, "head.weight": w})
    assert not w.any()  # refused before any read

"""Loading into a module: ties the module cannot hold, ties from a distributed checkpoint, failed loads.

Each test failed before the fix that came with it, but the three marked "Guard": an index tie
between tensors of different shapes was applied (wrong bytes); a distributed checkpoint of a tied
model did not load into that model (strict) or left the tie's other name untied with its old values
(assign=True); a shard found missing or wrong part-way left the module half overwritten.
"""

import os

import pytest
import torch
from hf_helpers import Tied

from shardkit.errors import MetadataError, MissingShardError, TensorMismatchError
from shardkit.hf import hf_to_distributed, load_checkpoint, retie_parameters, save_checkpoint

# -- 1. a tie recorded in the index between tensors of different shapes or dtypes


class TwoLinear(torch.nn.Module):
    def __init__(self, b_in=4, b_out=4, b_dtype=torch.float32, tied=False):
        super().__init__()
        self.a = torch.nn.Linear(4, 4, bias=False)
        self.b = torch.nn.Linear(b_in, b_out, bias=False, dtype=b_dtype)
        if tied:
            self.b.weight = self.a.weight


def _saved_tied(tmp_path) -> str:
    out = str(tmp_path / "tied")
    save_checkpoint(out, TwoLinear(tied=True), safetensors=True)  # stores a.weight, records [a.weight, b.weight]
    return out


@pytest.mark.parametrize("assign", [False, True])
def test_index_tie_between_different_shapes_is_refused_before_loading(tmp_path, assign):
    out = _saved_tied(tmp_path)
    m = TwoLinear(b_in=8, b_out=2)
    a_before, b_weight = m.a.weight.detach().clone(), m.b.weight
    with pytest.raises(TensorMismatchError, match=r"'b.weight' to 'a.weight'.*\[2, 8\].*\[4, 4\]"):
        load_checkpoint(out, m, strict=True, assign=assign)
    assert m.b.weight is b_weight and tuple(m.b.weight.shape) == (2, 8)
    assert torch.equal(m.a.weight, a_before)  # refused before anything was read


def test_index_tie_between_different_dtypes_is_refused(tmp_path):
    out = _saved_tied(tmp_path)
    m = TwoLinear(b_dtype=torch.float64)
    with pytest.raises(TensorMismatchError, match=r"torch.float64.*torch.float32"):
        load_checkpoint(out, m)
    assert m.b.weight.dtype == torch.float64 and m.b.weight is not m.a.weight


def test_retie_parameters_refuses_different_shapes():
    m = TwoLinear(b_in=8, b_out=2)
    with pytest.raises(TensorMismatchError, match=r"'b.weight'.*\[2, 8\].*'a.weight'.*\[4, 4\]"):
        retie_parameters(m, [["a.weight", "b.weight"]])
    assert tuple(m.b.weight.shape) == (2, 8)


def test_assign_load_in_another_dtype_still_ties(tmp_path):
    """Guard: an assign=True load gives the first name the checkpoint's dtype, and the tie passes it on."""
    out = str(tmp_path)
    save_checkpoint(out, Tied().to(torch.bfloat16), safetensors=True)
    dst = Tied()
    load_checkpoint(out, dst, assign=True)
    assert dst.head.weight is dst.emb.weight and dst.emb.weight.dtype == torch.bfloat16


# -- 2. a distributed checkpoint of a tied model, loaded into that model


def _tied_distributed(tmp_path):
    torch.manual_seed(0)
    src = Tied()
    save_checkpoint(str(tmp_path / "hf"), src, safetensors=True)
    hf_to_distributed(str(tmp_path / "hf"), str(tmp_path / "dist"))  # holds emb.weight only
    return src, str(tmp_path / "dist")


@pytest.mark.parametrize("strict,assign", [(True, False), (True, True), (False, True), (False, False)])
def test_distributed_checkpoint_loads_into_tied_module(tmp_path, strict, assign):
    """(strict=False, assign=False) is a guard: an in-place copy fills both names of the tie."""
    src, dist = _tied_distributed(tmp_path)
    torch.manual_seed(1)
    dst = Tied()
    load_checkpoint(dist, dst, strict=strict, assign=assign)
    assert dst.head.weight is dst.emb.weight
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_distributed_checkpoint_missing_untied_tensor_is_still_an_error(tmp_path):
    """Guard: ties cover only tied names."""
    _, dist = _tied_distributed(tmp_path)
    dst = Tied()
    dst.extra = torch.nn.Linear(2, 2)
    with pytest.raises(TensorMismatchError, match="extra.weight"):
        load_checkpoint(dist, dst)


# -- 3. a load that fails part-way leaves the module as it was


class Two(torch.nn.Module):
    def __init__(self, q_size=64):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(64))
        self.q = torch.nn.Parameter(torch.zeros(q_size))


def _two_shards(tmp_path) -> str:
    src = Two()
    with torch.no_grad():
        src.p.fill_(7)
        src.q.fill_(9)
    out = str(tmp_path)
    save_checkpoint(out, src, safetensors=True, max_shard_size=256)  # p in shard 1, q in shard 2
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    return out


def test_missing_second_shard_is_refused_before_the_first_is_read(tmp_path):
    out = _two_shards(tmp_path)
    os.remove(os.path.join(out, "model-00002-of-00002.safetensors"))
    dst = Two()
    with pytest.raises(MissingShardError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(out, dst)
    assert torch.count_nonzero(dst.p) == 0


def test_malformed_second_shard_is_refused_before_the_first_is_read(tmp_path):
    out = _two_shards(tmp_path)
    with open(os.path.join(out, "model-00002-of-00002.safetensors"), "r+b") as f:
        f.write(b"\xff" * 8)  # a header length past the end of the file
    dst = Two()
    with pytest.raises(MetadataError):
        load_checkpoint(out, dst)
    assert torch.count_nonzero(dst.p) == 0


def test_wrong_shape_in_second_shard_is_refused_before_the_first_is_read(tmp_path):
    out = _two_shards(tmp_path)
    dst = Two(q_size=32)
    with pytest.raises(TensorMismatchError, match=r"'q'.*\[64\].*\[32\]"):
        load_checkpoint(out, dst)
    assert torch.count_nonzero(dst.p) == 0


def test_distributed_load_with_a_wrong_shape_leaves_the_module_as_it_was(tmp_path):
    _, dist = _tied_distributed(tmp_path)
    dst = Tied()
    dst.body = torch.nn.Linear(16, 8)
    emb_before = dst.emb.weight.detach().clone()
    with pytest.raises(TensorMismatchError, match="body.weight"):
        load_checkpoint(dist, dst)
    assert torch.equal(dst.emb.weight, emb_before)

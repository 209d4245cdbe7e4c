"""A Hugging Face save refuses, before touching the directory, what it could not write or read back.

Each refused save must leave the previous checkpoint byte for byte as it was
(it used to be deleted first), and raise a typed error naming the entry.
"""

import json
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.hf import (
    find_latest_checkpoint,
    load_checkpoint,
    load_checkpoint_metrics,
    next_checkpoint_path,
    save_checkpoint,
    save_checkpoint_metrics,
    save_shard_index,
    validate_checkpoint,
)
from shardkit.hf.metrics import METRICS_FILE_NAME


def _snapshot(path) -> dict:
    """Every file of ``path`` (name -> bytes)."""
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _previous(tmp_path, safetensors=True) -> tuple[str, dict]:
    path = next_checkpoint_path(str(tmp_path / "run"), 1)
    save_checkpoint(path, {"w": torch.arange(4.0)}, metadata={"step": 1}, safetensors=safetensors)
    return path, _snapshot(path)


def _assert_untouched(path, before, run_dir=None) -> None:
    assert _snapshot(path) == before
    assert validate_checkpoint(path)
    assert load_checkpoint(path, None)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    if run_dir is not None:
        assert find_latest_checkpoint(run_dir) == path


def _sparse_csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return torch.eye(3).to_sparse_csr()


_BAD_TENSORS = [
    pytest.param(True, lambda: torch.zeros(2, dtype=torch.complex128), ["'x'", "complex128", "safetensors=False"],
                 id="complex128-safetensors"),
    pytest.param(True, lambda: torch.empty(3, device="meta"), ["'x'", "meta", "to_empty"], id="meta-safetensors"),
    pytest.param(False, lambda: torch.empty(3, device="meta"), ["'x'", "meta", "to_empty"], id="meta-bin"),
    pytest.param(True, lambda: torch.eye(3).to_sparse(), ["'x'", "sparse_coo", "to_dense"], id="sparse-coo"),
    pytest.param(False, lambda: torch.eye(3).to_sparse(), ["'x'", "sparse_coo", "to_dense"], id="sparse-coo-bin"),
    pytest.param(True, _sparse_csr, ["'x'", "sparse_csr", "to_dense"], id="sparse-csr"),
    pytest.param(False, lambda: torch.empty(4, dtype=torch.uint4), ["'x'", "uint4", "torch.save"], id="uint4-bin"),
]


@pytest.mark.parametrize("safetensors, make, words", _BAD_TENSORS)
def test_unsavable_tensor_is_refused_and_previous_checkpoint_kept(tmp_path, safetensors, make, words):
    path, before = _previous(tmp_path, safetensors)
    with pytest.raises(TensorMismatchError) as caught:
        save_checkpoint(path, {"w": torch.arange(4.0) + 1, "x": make()}, safetensors=safetensors)
    for word in words:
        assert word in str(caught.value)
    _assert_untouched(path, before, str(tmp_path / "run"))


def test_meta_module_is_refused_with_how_to_materialise(tmp_path):
    path, before = _previous(tmp_path)
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    with pytest.raises(TensorMismatchError, match="to_empty"):
        save_checkpoint(path, model, safetensors=True)
    _assert_untouched(path, before)


@pytest.mark.parametrize("safetensors", [True, False])
def test_tensor_named_like_the_safetensors_header_metadata_is_refused(tmp_path, safetensors):
    path, before = _previous(tmp_path, safetensors)
    with pytest.raises(TensorMismatchError, match="__metadata__.*Rename"):
        save_checkpoint(path, {"w": torch.arange(4.0) + 1, "__metadata__": torch.ones(2)}, safetensors=safetensors)
    _assert_untouched(path, before)


_BAD_METADATA = [
    pytest.param({"step": np.int64(5)}, ["'step'", "numpy.int64", "int(x)"], id="numpy-int64"),
    pytest.param({"loss": float("nan")}, ["'loss'", "nan"], id="nan"),
    pytest.param({"best": float("inf")}, ["'best'", "inf"], id="inf"),
    pytest.param({"worst": -float("inf")}, ["'worst'", "-inf"], id="minus-inf"),
    pytest.param({"hist": {"losses": [1.0, float("nan")]}}, ["['hist']['losses'][1]", "nan"], id="nested-nan"),
    pytest.param({"lr": torch.tensor(0.1)}, ["'lr'", "Tensor", ".tolist()"], id="tensor"),
    pytest.param({"seed": 10**50}, ["'seed'", "str(x)"], id="integer-too-long-to-read"),
    pytest.param({"tags": {1.5j: 1}}, ["key", "str(key)"], id="complex-key"),
]


@pytest.mark.parametrize("metadata, words", _BAD_METADATA)
def test_metadata_the_index_cannot_hold_is_refused_and_previous_checkpoint_kept(tmp_path, metadata, words):
    path, before = _previous(tmp_path)
    with pytest.raises(MetadataError) as caught:
        save_checkpoint(path, {"w": torch.arange(4.0) + 1}, metadata=metadata, safetensors=True)
    for word in words:
        assert word in str(caught.value)
    _assert_untouched(path, before, str(tmp_path / "run"))


def test_metadata_that_is_not_a_dict_is_refused(tmp_path):
    path, before = _previous(tmp_path)
    with pytest.raises(MetadataError, match="metadata must be a dict"):
        save_checkpoint(path, {"w": torch.arange(4.0) + 1}, metadata=[("step", 1)], safetensors=True)
    _assert_untouched(path, before)


def test_plain_metadata_still_round_trips(tmp_path):
    path = str(tmp_path / "ck")
    metadata = {"step": 7, "loss": 1.5, "note": "é", "none": None, "nested": {"a": [1, 2.5, True, "x"]},
                "numpy_float": np.float64(0.25), "big": 10**39}
    save_checkpoint(path, {"w": torch.ones(2)}, metadata=metadata, safetensors=True)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        saved = json.load(f)["metadata"]
    assert {k: saved[k] for k in metadata} == metadata
    assert load_checkpoint(path, None)["w"].tolist() == [1.0, 1.0]


def test_save_shard_index_refuses_nan_and_writes_nothing(tmp_path):
    index = {"metadata": {"total_size": 8, "loss": float("nan")}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    with pytest.raises(MetadataError, match="'loss'"):
        save_shard_index(index, str(tmp_path / "out"), "model.safetensors.index.json")
    assert not os.path.exists(tmp_path / "out" / "model.safetensors.index.json")


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan"), 10**400], ids=["inf", "-inf", "nan", "huge"])
def test_non_finite_metric_is_refused_and_previous_metrics_kept(tmp_path, value):
    path = str(tmp_path / "ck")
    save_checkpoint_metrics(path, {"eval_loss": 2.0})
    with pytest.raises(MetadataError, match="'eval_loss'"):
        save_checkpoint_metrics(path, {"eval_loss": value, "acc": 0.5})
    assert load_checkpoint_metrics(path) == {"eval_loss": 2.0}


def test_non_finite_metric_creates_nothing(tmp_path):
    path = tmp_path / "fresh"
    with pytest.raises(MetadataError, match="finite"):
        save_checkpoint_metrics(str(path), {"eval_loss": float("inf")})
    assert not (path / METRICS_FILE_NAME).exists()

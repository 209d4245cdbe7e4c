"""The CLI with plain values JSON cannot hold (NaN, infinities, bytes, numpy scalars): ``convert`` of a DCP
checkpoint keeps them, ``reshard`` carries them on, ``inspect`` shows them (``--json`` in
``metadata.json``'s typed form, strict JSON), ``diff`` compares them. The library side:
``tests/checkpoint/test_plain_values.py``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cli_helpers import assert_one_line_error, dcp_state, in_process
from shardkit import knobs
from shardkit.checkpoint import load_consolidated, save
from shardkit.hf import distributed_to_hf

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DCP_VALUES = {"best": math.inf, "worst": -math.inf, "loss": math.nan}
DCP_BYTES = {"loader": b"\x80\x04state\x00", **DCP_VALUES}


def _dcp(path, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _strict(text: str):
    def refuse(word):
        raise AssertionError(f"not strict JSON: {word}")
    return json.loads(text, parse_constant=refuse)


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


def _convert_keeps(tmp_path, values: dict) -> None:
    src = _dcp(tmp_path / "dcp", {**dcp_state(), **values})
    code, _, err = in_process("convert", src, tmp_path / "dist", "--to", "distributed", "-q")
    assert code == 0, err
    back = load_consolidated(str(tmp_path / "dist"))
    assert all(_same(back.get(k), v) for k, v in values.items()), {k: back.get(k) for k in values}
    assert in_process("reshard", tmp_path / "dist", tmp_path / "ws2", "--world-size", "2", "-q")[0] == 0
    back = load_consolidated(str(tmp_path / "ws2"))
    assert all(_same(back.get(k), v) for k, v in values.items())
    code, out, err = in_process("diff", src, tmp_path / "ws2")
    assert code == 0 and "identical" in out, out + err


def test_convert_of_a_dcp_holding_infinities_and_nan_keeps_them(tmp_path):
    _convert_keeps(tmp_path, DCP_VALUES)


def test_convert_of_a_dcp_holding_bytes_and_infinities_keeps_them(tmp_path):
    _convert_keeps(tmp_path, DCP_BYTES)


def test_convert_refuses_bytes_over_the_limit_naming_the_value(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "MAX_BYTES_VALUE", 16)
    src = _dcp(tmp_path / "dcp", {**dcp_state(), "blob": b"x" * 17})
    line = assert_one_line_error(*in_process("convert", src, tmp_path / "o", "--to", "distributed"))
    assert "'blob'" in line and "uint8 tensor" in line and "internal error" not in line
    assert not (tmp_path / "o").exists()


def _saved(tmp_path, **values):
    save({"w": torch.ones(2), **values}, tmp_path / "ck")
    return tmp_path / "ck"


def test_inspect_shows_each_kind_and_json_holds_the_typed_form(tmp_path):
    ck = _saved(tmp_path, best=math.inf, loss=math.nan, loader=b"\x00\x01", f32=np.float32(1.5), f64=np.float64(2.5),
                word="nan", big=b"\xff" * 200)
    code, out, err = in_process("inspect", ck)
    assert code == 0, err
    for line in ("best = Infinity", "loss = NaN", "loader = b'\\x00\\x01'", "f32 = np.float32(1.5)",
                 "f64 = np.float64(2.5)", "word = 'nan'", "(200 bytes)"):
        assert line in out, (line, out)
    code, out, err = in_process("inspect", ck, "--json")
    assert code == 0, err
    objects = _strict(out)["objects"]
    assert objects == {"best": {"float": "Infinity"}, "loss": {"float": "NaN"}, "loader": {"bytes": "AAE="},
                       "f32": {"numpy.float32": 1.5}, "f64": {"numpy.float64": 2.5}, "word": "nan",
                       "big": {"bytes": objects["big"]["bytes"]}}


def test_diff_compares_them_by_type_and_value(tmp_path):
    a = _saved(tmp_path / "a", loss=np.float32("nan"), blob=b"A", best=math.inf)
    same = _saved(tmp_path / "same", loss=np.float32("nan"), blob=b"A", best=math.inf)
    code, out, err = in_process("diff", a, same)
    assert code == 0 and "identical" in out, out + err
    other = _saved(tmp_path / "b", loss=np.float64("nan"), blob=b"B", best=-math.inf)
    code, out, err = in_process("diff", a, other)
    assert code == 1, out + err
    for name in ("loss", "blob", "best"):
        assert f"~ {name}  value" in out, (name, out)


def test_distributed_to_hf_keeps_the_models_plain_values_in_strict_json_and_convert_gives_them_back(tmp_path):
    values = {"best": math.inf, "loss": math.nan, "blob": b"\x00\xffstate", "scale": np.float32(0.5)}
    save({"w": torch.ones(2, 3), **values}, tmp_path / "ck")
    distributed_to_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))   # model tensors, and the values beside them
    index = _strict((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["metadata"]["shardkit_objects"]) == set(values)
    code, _, err = in_process("convert", tmp_path / "hf", tmp_path / "back", "--to", "distributed", "-q")
    assert code == 0, err
    back = load_consolidated(str(tmp_path / "back"))
    assert all(_same(back.get(k), v) for k, v in values.items()), {k: back.get(k) for k in values}

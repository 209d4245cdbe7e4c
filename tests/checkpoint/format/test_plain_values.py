"""Every plain value a training loop holds saves and loads as it was: NaN and infinities, bytes and
bytearray, numpy scalars (their type kept), ints longer than a JSON literal; through ``save``/``load``
(``rank_state=`` too), ``async_save``, the manager, ``save_distributed``/``load_distributed``/
``load_consolidated``, on one process and on two Gloo ranks. ``metadata.json`` stays strict JSON,
a string that spells an encoding stays a string, files of earlier versions read as before, and what
the format cannot hold is refused, naming the leaf. The CLI (convert, inspect, diff):
``tests/cli/test_convert_plain_values.py``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ranks import run_ranks
from shardkit import knobs
from shardkit.checkpoint import (CheckpointManager, ShardMetadata, TensorShardSpec, async_save, load,
                                 load_consolidated, load_distributed, read_metadata, save, save_distributed)
from shardkit.checkpoint.format.manifest import Manifest, manifest_to_json, parse_manifest
from shardkit.checkpoint.format.nested import flatten, unflatten
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.storage.plain_values import NUMPY_SCALAR_DTYPES

VALUES = {
    "best_loss": math.inf, "worst": -math.inf, "loss": math.nan, "neg_zero": -0.0, "tiny": 5e-324, "lr": 0.1,
    "loader": b"\x80\x04\x95\x00\xff state", "no_bytes": b"", "buf": bytearray(b"\x00\x01"),
    "f16": np.float16(0.1), "f32": np.float32(1.1), "f32_nan": np.float32("nan"), "f32_ninf": np.float32("-inf"),
    "f64": np.float64(0.1), "i8": np.int8(-128), "i16": np.int16(300), "i32": np.int32(7), "i64": np.int64(3),
    "u8": np.uint8(255), "u16": np.uint16(65535), "u32": np.uint32(4_000_000_000), "u64": np.uint64(2**64 - 1),
    "flag": np.bool_(False), "big": 2**200, "neg_big": -(2**200), "step": 7, "text": "nan", "none": None, "yes": True,
}

#: Strings (and a dict) that spell an encoding, or a JSON word a parser might take for a float: they stay as they are.
LOOKALIKES = {"a": "nan", "b": "NaN", "c": "Infinity", "d": "-Infinity", "e": '{"bytes": "aGk="}', "f": "aGk=",
              "g": "numpy.float32", "h": "", "i": {"bytes": "aGk="}, "j": {"float": "NaN"}, "k": {"int": "1"}}


def same(a, b) -> bool:
    """Equal with the same type all the way down; NaN equals NaN, -0.0 only -0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (float, np.floating)) and (math.isnan(a) or a == 0):
        return math.isnan(b) if math.isnan(a) else math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


def state():
    return {"model": {"w": torch.arange(6.0)}, "train": dict(VALUES),
            "history": [math.inf, b"x", (np.int64(1), math.nan)], "empty": {"d": {}, "l": [], "t": ()},
            "look": dict(LOOKALIKES)}


def blank(node):
    """``node`` with every plain leaf None (and tensors zeroed): the state a resumed job would load into."""
    if isinstance(node, torch.Tensor):
        return torch.zeros_like(node)
    if isinstance(node, dict):
        return {k: blank(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(blank(v) for v in node)
    return None


def _strict(text: str):
    def refuse(word):
        raise AssertionError(f"not strict JSON: {word}")
    return json.loads(text, parse_constant=refuse)


# -- one process ------------------------------------------------------------------------------------------

def test_each_kind_round_trips_through_save_load_and_load_consolidated(tmp_path):
    saved = state()
    save(saved, tmp_path / "ck")
    target = blank(saved)
    load(target, tmp_path / "ck")
    assert same(target, saved), target
    assert same(load_consolidated(str(tmp_path / "ck")), saved)
    assert same(load_distributed(str(tmp_path / "ck"), 1, 2)["train"], saved["train"])


def test_metadata_json_is_strict_json_with_one_key_objects_for_what_json_cannot_hold(tmp_path):
    save(state(), tmp_path / "ck")
    objects = _strict((tmp_path / "ck" / "metadata.json").read_text())["objects"]
    assert objects["train.best_loss"] == {"float": "Infinity"} and objects["train.loss"] == {"float": "NaN"}
    assert objects["train.loader"] == {"bytes": "gASVAP8gc3RhdGU="} and objects["train.buf"] == {"bytearray": "AAE="}
    assert objects["train.f32"] == {"numpy.float32": float(np.float32(1.1))}
    assert objects["train.f32_nan"] == {"numpy.float32": "NaN"} and objects["train.flag"] == {"numpy.bool": False}
    assert objects["train.u64"] == {"numpy.uint64": 2**64 - 1} and objects["train.big"] == {"int": str(2**200)}
    # JSON's own values are themselves, as every earlier version wrote them; no empty container is an object
    assert [objects[f"train.{k}"] for k in ("step", "lr", "text", "none", "yes")] == [7, 0.1, "nan", None, True]
    assert objects["look.e"] == '{"bytes": "aGk="}' and objects["look.i.bytes"] == "aGk="
    assert not any(name.startswith("empty") for name in objects)


def test_a_string_or_dict_that_spells_an_encoding_stays_what_it_was(tmp_path):
    save({"w": torch.ones(1), **LOOKALIKES}, tmp_path / "ck")
    back = load_consolidated(str(tmp_path / "ck"))
    assert same({k: back[k] for k in LOOKALIKES}, LOOKALIKES)


def test_rank_state_plain_values_come_back_per_rank(tmp_path):
    rng = {"torch": torch.get_rng_state(), "loader": b"\x00pos=17", "best": -math.inf, "seen": np.int64(123)}
    save({"w": torch.ones(2)}, tmp_path / "ck", rank_state=rng)
    into = {"torch": torch.zeros_like(rng["torch"]), "loader": b"", "best": 0.0, "seen": np.int64(0)}
    load({"w": torch.zeros(2)}, tmp_path / "ck", rank_state=into)
    assert same(into, rng)


def test_async_save_writes_the_values_as_they_were_when_it_returned(tmp_path):
    saved = state()
    buf = saved["train"]["buf"]
    future = async_save(saved, tmp_path / "ck")
    buf[0] = 0x7F  # the caller's bytearray changes while the save runs: the staged copy is written
    future.wait()
    back = load_consolidated(str(tmp_path / "ck"))
    assert back["train"]["buf"] == bytearray(b"\x00\x01") and same(back["history"], saved["history"])
    saved["train"]["buf"] = bytearray(b"\x00\x01")
    assert same(back, saved)


@pytest.mark.parametrize("background", [True, False])
def test_the_manager_saves_and_restores_them(tmp_path, background):
    saved = state()
    with CheckpointManager(tmp_path / "run", async_save=background) as mgr:
        mgr.save(5, saved, rank_state={"loader": b"abc", "ema": np.float32("inf")})
        mgr.wait()
        target, rank_state = blank(saved), {"loader": None, "ema": None}
        assert mgr.restore(target, rank_state=rank_state) == 5
    assert same(target, saved) and same(rank_state, {"loader": b"abc", "ema": np.float32("inf")})


def test_save_distributed_without_a_group_and_the_version_1_readers(tmp_path):
    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    plain = {"best": math.inf, "loss": math.nan, "loader": b"\x01\x02", "f32": np.float32(0.5), "big": 3**100}
    for rank in (1, 0):  # the same plain values on every rank: one save_id, whatever NaN does to equality
        save_distributed({"w": torch.arange(4.0)[2 * rank: 2 * rank + 2], **plain}, str(tmp_path / "ck"), rank, 2, spec)
    assert read_metadata(str(tmp_path / "ck")).format_version == 3   # save_distributed writes version 3 now
    for back in (load_consolidated(str(tmp_path / "ck")), load_distributed(str(tmp_path / "ck"), 0, 3)):
        assert same({k: back[k] for k in plain}, plain)
    assert same(load_consolidated(str(tmp_path / "ck"), keys="loader"), {"loader": b"\x01\x02"})


def test_a_checkpoint_of_an_earlier_version_loads_as_before(tmp_path):
    # Written as every earlier version wrote objects (JSON's own values only): a word such as "NaN" was
    # always a string there, and stays one.
    save({"w": torch.ones(2), "a": 0, "b": 0, "c": 0, "d": 0}, tmp_path / "ck")
    path = tmp_path / "ck" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["objects"] = {"a": "NaN", "b": 1e308, "c": None, "d": 1}
    path.write_text(json.dumps(meta))
    assert same(load_consolidated(str(tmp_path / "ck")), {"w": torch.ones(2), **meta["objects"]})


# -- two Gloo ranks ---------------------------------------------------------------------------------------

def _two_ranks(rank, world_size, path):
    shared = {"best": math.inf, "blob": b"same on every rank", "f32": np.float32(0.25)}
    mine = {"loader": bytes([rank]) * 3, "seen": np.uint32(10 + rank), "loss": math.nan if rank else -math.inf}
    save({"w": torch.arange(4.0), **shared}, path, rank_state=mine)
    into_state = {"w": torch.zeros(4), "best": None, "blob": None, "f32": None}
    into_rank = {"loader": None, "seen": None, "loss": None}
    load(into_state, path, rank_state=into_rank)
    return {k: v for k, v in into_state.items() if k != "w"}, into_rank


@pytest.mark.multiproc
def test_two_gloo_ranks_save_and_load_shared_and_per_rank_values(tmp_path):
    path = str(tmp_path / "ck")
    results = run_ranks(_two_ranks, 2, tmp_path, path)
    for rank, (shared, mine) in enumerate(results):
        assert same(shared, {"best": math.inf, "blob": b"same on every rank", "f32": np.float32(0.25)})
        assert same(mine, {"loader": bytes([rank]) * 3, "seen": np.uint32(10 + rank),
                           "loss": math.nan if rank else -math.inf})
    objects = read_metadata(path).objects
    assert objects["__rank_state__.1.loader"] == b"\x01\x01\x01"


# -- what the format cannot hold, and files that lie --------------------------------------------------------

@pytest.mark.parametrize("value", [{1, 2}, 1 + 2j, np.longdouble(1), np.complex64(1), np.array(1.5), object(),
                                   memoryview(b"x"), np.datetime64("2020-01-01")],
                         ids=["set", "complex", "longdouble", "complex64", "0-d array", "object", "memoryview",
                              "datetime64"])
def test_what_objects_cannot_hold_is_refused_naming_the_leaf(tmp_path, value):
    with pytest.raises(TypeError, match=r"'opt\.x'"):
        save({"w": torch.ones(1), "opt": {"x": value}}, tmp_path / "ck")
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_bytes_over_the_limit_are_refused_saying_to_store_a_uint8_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "MAX_BYTES_VALUE", 64)
    save({"w": torch.ones(1), "blob": b"x" * 64}, tmp_path / "ok")  # the limit itself is kept
    with pytest.raises(TensorMismatchError, match=r"'blob' is 65 bytes.*MAX_BYTES_VALUE.*uint8 tensor"):
        save({"w": torch.ones(1), "blob": bytearray(65)}, tmp_path / "ck")
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_a_metadata_json_larger_than_readers_accept_is_never_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "MAX_INDEX_BYTES", 4000)
    with pytest.raises(TensorMismatchError, match=r"metadata.json would be .* bytes.*MAX_INDEX_BYTES.*plain values"):
        save({"w": torch.ones(1), **{f"b{i}": bytes(900) for i in range(4)}}, tmp_path / "ck")
    assert not (tmp_path / "ck" / "metadata.json").exists()


@pytest.mark.parametrize("raw, message", [
    ({"bytes": "not base64!"}, "well-formed 'bytes'"), ({"bytes": 5}, "well-formed"),
    ({"float": "nan"}, "well-formed 'float'"), ({"float": 1.5}, "well-formed"),
    ({"numpy.int8": 300}, "well-formed"), ({"numpy.uint64": -1}, "well-formed"), ({"numpy.bool": 1}, "well-formed"),
    ({"numpy.int64": True}, "well-formed"), ({"numpy.float16": 1e300}, "well-formed"),
    ({"numpy.float32": "Inf"}, "well-formed"), ({"int": "12a"}, "well-formed"), ({"int": "\u0663"}, "well-formed"),
    ({"numpy.complex64": [1, 2]}, "does not know"), ({"a": 1}, "does not know"),
    ({"bytes": "aGk=", "x": 1}, "one key"), ([1, 2], "one key"),
])
def test_a_damaged_object_is_a_metadata_error_naming_it(tmp_path, raw, message):
    save({"w": torch.ones(1), "x": 1}, tmp_path / "ck")
    path = tmp_path / "ck" / "metadata.json"
    meta = json.loads(path.read_text())
    meta["objects"]["x"] = raw
    path.write_text(json.dumps(meta))
    with pytest.raises(MetadataError, match=f"object 'x'.*{message}"):
        read_metadata(str(tmp_path / "ck"))


# -- any mix, nested ------------------------------------------------------------------------------------------

def _numpy(name: str):
    scalar = np.dtype(name).type
    if name == "bool":
        return st.booleans().map(scalar)
    if name.startswith(("int", "uint")):
        info = np.iinfo(scalar)
        return st.integers(int(info.min), int(info.max)).map(scalar)
    return st.floats(width=np.dtype(name).itemsize * 8).map(scalar)


LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**300), 2**300), st.floats(), st.text(max_size=6),
                   st.sampled_from([v for v in LOOKALIKES.values() if isinstance(v, str)]),
                   st.binary(max_size=12), st.binary(max_size=6).map(bytearray),
                   st.sampled_from(NUMPY_SCALAR_DTYPES).flatmap(_numpy))
KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=3)
NESTED = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=3) | st.lists(kids, max_size=3).map(tuple)
                      | st.dictionaries(KEYS, kids, max_size=3), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, NESTED, max_size=4))
def test_any_nested_mix_survives_metadata_json(nested):
    flat = flatten(nested)
    text = json.dumps(manifest_to_json(Manifest(1, 1, {}, {}, flat.objects, flat.structure)), allow_nan=False)
    m = parse_manifest("metadata.json", text.encode())
    assert same(unflatten(m.structure, m.objects), nested)

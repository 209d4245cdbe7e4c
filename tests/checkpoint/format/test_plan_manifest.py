"""Plans, nested state and manifests as plain data: no tensors on disk."""

import json

import pytest
import torch

from shardkit.checkpoint.format.manifest import Manifest, SavedTensor, manifest_to_json, parse_manifest
from shardkit.checkpoint.format.nested import flatten, select_names, unflatten
from shardkit.checkpoint.planning.plan import plan_load, spec_chunk_plan, wanted_box
from shardkit.checkpoint.format.spec import TensorShardSpec
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import Box


def _writers(plan, name):
    return sorted(plan.tensors[name].box_to_writer.values())


def test_save_plan_spreads_replicated_owners_by_bytes():
    shapes = {"big": (250,), "mid": (150,), "small": (125,), "tiny": (3,), "w": (1000,)}   # F32: 4 bytes each
    specs = {"w": TensorShardSpec((1000,), 0, (500, 500))}
    plan = spec_chunk_plan({n: (s, "F32") for n, s in shapes.items()}, specs, 2, {"F32": 4}.get)
    assert {n: _writers(plan, n) for n in shapes} == {"big": [0], "mid": [1], "small": [1], "tiny": [0], "w": [0, 1]}
    written = plan.writes[0] + plan.writes[1]
    assert sorted(written) == sorted(["w", "w", "big", "mid", "small", "tiny"])  # replicated once each


def test_save_plan_gives_empty_tensors_and_boxes_no_chunk():
    specs = {"s": TensorShardSpec((4, 3), 0, (4, 0))}
    plan = spec_chunk_plan({"e": ((0,), "F32"), "s": ((4, 3), "F32")}, specs, 2, {"F32": 4}.get)
    assert plan.tensors["e"].box_to_writer == {} and plan.writes == [["s"], []]


def _saved(shape, dim, sizes, owner=None):
    return SavedTensor(TensorShardSpec(shape, dim, sizes), "F32", owner)


def test_load_plan_touches_only_overlapping_files():
    tensors = {"w": _saved((12, 4), 0, (3, 3, 3, 3)), "r": _saved((5,), None, (), owner=2)}
    want = {"w": wanted_box(tensors["w"], 4, 0, 3), "r": wanted_box(tensors["r"], 4, 0, 3)}
    assert want["w"] == Box((0, 0), (4, 4))
    plans = {p.name: p for p in plan_load(tensors, want, lambda n: 1 << 20)}
    assert [c.file for c in plans["w"].reads] == ["rank_0.safetensors", "rank_1.safetensors"]
    assert [(p.src_start, p.src_numel, p.dst_start, p.direct) for c in plans["w"].reads for p in c.pieces] == \
        [(0, 12, 0, True), (0, 4, 12, True)]
    assert [c.file for c in plans["r"].reads] == ["rank_2.safetensors"]


def test_load_plan_scatter_reads_are_bounded():
    tensors = {"w": _saved((64, 8), 1, (4, 4))}
    plan, = plan_load(tensors, {"w": wanted_box(tensors["w"], 2, 1, 3)}, lambda n: 20)
    pieces = [p for c in plan.reads for p in c.pieces]
    assert pieces and all(not p.direct and p.src_numel <= 20 for p in pieces)


def test_nested_round_trip_with_int_keys_and_tuples():
    state = {"m": {"w": torch.ones(2)}, "opt": {"state": {3: {"step": 5}}, "groups": [{"betas": (0.9, 0.99)}]}}
    flat = flatten(state)
    assert list(flat.tensors) == ["m.w"] and flat.objects == {"opt.state.3.step": 5, "opt.groups.0.betas.0": 0.9,
                                                             "opt.groups.0.betas.1": 0.99}
    structure = json.loads(json.dumps(flat.structure))        # survives JSON
    back = unflatten(structure, {**flat.tensors, **flat.objects})
    assert back["opt"] == state["opt"] and torch.equal(back["m"]["w"], state["m"]["w"])
    assert unflatten(structure, {"m.w": 1}, keep={"m.w"}) == {"m": {"w": 1}}


def test_nested_refuses_what_json_cannot_hold():
    with pytest.raises(TypeError, match="'x' is a set"):
        flatten({"x": {1, 2}})
    with pytest.raises(TypeError, match="key .* is a tuple"):
        flatten({(1, 2): 3})
    with pytest.raises(TypeError, match="must be a dict"):
        flatten([torch.ones(1)])


def test_select_names_by_prefix():
    names = ["model.w", "model.b", "models.x", "step"]
    assert select_names(names, ["model"]) == ["model.w", "model.b"]
    assert select_names(names, "step") == ["step"]
    with pytest.raises(TensorMismatchError, match="'opt' is not in the checkpoint; it holds: model.b"):
        select_names(names, ["opt"])


def test_manifest_round_trip_and_seed_schema():
    m = Manifest(1, 2, {"w": _saved((4,), 0, (2, 2)), "r": _saved((), None, (), owner=1)},
                 objects={"step": 1}, structure={"dict": [["w", "T"], ["r", "T"], ["step", "O"]]})
    back = parse_manifest("m.json", json.dumps(manifest_to_json(m)).encode())
    assert back.tensors == m.tensors and back.objects == {"step": 1} and back.format_version == 1
    seed = {"num_ranks": 2, "tensor_specs": {"w": {"full_shape": [4], "shard_dim": 0, "shard_sizes": [2, 2]}}}
    parsed = parse_manifest("seed.json", json.dumps(seed).encode())
    assert parsed.format_version is None and parsed.tensors["w"].dtype is None


@pytest.mark.parametrize("edit,message", [
    (lambda o: o.update(format="other"), "has format 'other'"),
    (lambda o: o.update(format_version=4), "format_version 4; this shardkit supports 1, 2, 3"),
    (lambda o: o.update(num_ranks=0), "num_ranks is 0"),
    (lambda o: o["tensor_specs"]["w"].update(shard_dim=3), "shard_dim 3"),
    (lambda o: o["tensor_specs"]["w"].update(shard_sizes=[2]), "1 shard_sizes for 2 ranks"),
    (lambda o: o["tensor_specs"]["r"].update(owner_rank=5), "owner_rank 5"),
    (lambda o: o["tensor_specs"]["w"].update(dtype="F128"), "dtype 'F128'"),
])
def test_manifest_errors_name_the_problem(edit, message):
    m = Manifest(1, 2, {"w": _saved((4,), 0, (2, 2)), "r": _saved((), None, (), owner=1)})
    obj = manifest_to_json(m)
    edit(obj)
    with pytest.raises(MetadataError, match=message):
        parse_manifest("m.json", json.dumps(obj).encode())

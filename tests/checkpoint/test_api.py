"""shardkit.checkpoint.save / load / async_save in one process; format version 2; the chunk planner."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

import shardkit.checkpoint as ckpt
from ckpt_helpers import save_v1
from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_consolidated
from shardkit.checkpoint.planning.chunk_plan import plan_chunks
from shardkit.errors import MetadataError, TensorMismatchError

W = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)


def test_save_is_the_function():
    import shardkit.checkpoint.saving.distributed_save as distributed_save

    assert callable(ckpt.save) and ckpt.save.__module__ == "shardkit.checkpoint.api"
    assert distributed_save.save_distributed is ckpt.save_distributed


def test_round_trip_in_place_with_plain_leaves(tmp_path):
    state = {"model": {"w": W.clone(), "b": torch.arange(4)}, "step": 7, "groups": [{"lr": 0.1}], "s": torch.tensor(2.5)}
    ckpt.save(state, tmp_path, metadata={"note": "x"})
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["format_version"] == 3 and meta["user_metadata"] == {"note": "x"}
    target = {"model": {"w": torch.zeros(7, 3), "b": torch.zeros(4, dtype=torch.int64)}, "step": 0,
              "groups": [{"lr": 0.0}], "s": torch.tensor(0.0)}
    w = target["model"]["w"]
    ckpt.load(target, tmp_path)
    assert target["model"]["w"] is w and torch.equal(w, W)          # in place
    assert target["step"] == 7 and target["groups"][0]["lr"] == 0.1 and target["s"].item() == 2.5
    assert ckpt.validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["model"]["w"], W)   # the other readers read version 2
    assert torch.equal(ckpt.load_region(tmp_path, "model.w", (2, 1), (3, 2)), W[2:5, 1:3])


@pytest.mark.parametrize("change, match", [
    (lambda s: s.update(extra=torch.zeros(1)), "leaves the checkpoint lacks: extra"),
    (lambda s: s.pop("step"), "leaves state_dict lacks: step"),
    (lambda s: s.update(w=torch.zeros(8, 3)), "global shape \\[8, 3\\]"),
    (lambda s: s.update(w=torch.zeros(7, 3, dtype=torch.float64)), "float64"),
    (lambda s: s.update(step=torch.zeros(1)), "plain value"),
])
def test_load_refuses_mismatches_before_reading(tmp_path, change, match):
    ckpt.save({"w": W, "step": 1}, tmp_path)
    target = {"w": torch.full((7, 3), -1.0), "step": 0}
    change(target)
    with pytest.raises(TensorMismatchError, match=match):
        ckpt.load(target, tmp_path)
    assert target.get("step") in (0, None)


def test_strict_false_ignores_leaves_the_state_lacks(tmp_path):
    ckpt.save({"w": W, "step": 1}, tmp_path)
    target = {"w": torch.zeros(7, 3)}
    ckpt.load(target, tmp_path, strict=False)
    assert torch.equal(target["w"], W)


def test_version_1_checkpoints_load_and_reshard_through_load(tmp_path):
    sizes = (4, 3)
    spec = ShardMetadata(2, {"w": TensorShardSpec((7, 3), 0, sizes)})
    for rank in range(2):   # no group: each rank saves alone, as the seed did (shardkit writes version 2 now)
        save_v1({"w": W[sum(sizes[:rank]):sum(sizes[:rank + 1])], "step": 3}, tmp_path, rank, 2, spec)
    assert json.loads((tmp_path / "metadata.json").read_text())["format_version"] == 1
    target = {"w": torch.zeros(7, 3), "step": 0}
    ckpt.load(target, tmp_path)
    assert torch.equal(target["w"], W) and target["step"] == 3


def test_seed_format_loads_through_load(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps(
        {"num_ranks": 2, "tensor_specs": {"w": {"full_shape": [7, 3], "shard_dim": 0, "shard_sizes": [4, 3]}}}))
    save_file({"w": W[:4].contiguous()}, str(tmp_path / "rank_0.safetensors"))
    save_file({"w": W[4:].contiguous()}, str(tmp_path / "rank_1.safetensors"))
    target = {"w": torch.zeros(7, 3)}
    ckpt.load(target, tmp_path)
    assert torch.equal(target["w"], W)


def test_async_save_holds_the_values_at_the_call(tmp_path):
    w = W.clone()
    future = ckpt.async_save({"w": w, "step": 2}, tmp_path)
    w.fill_(0)
    future.wait()
    target = {"w": torch.zeros(7, 3), "step": 0}
    ckpt.load(target, tmp_path)
    assert torch.equal(target["w"], W)


def _v2(tmp_path):
    ckpt.save({"w": W}, tmp_path)
    return json.loads((tmp_path / "metadata.json").read_text())


@pytest.mark.parametrize("corrupt, match", [
    (lambda c: c.update(offsets=[1, 0]), "leaves its shape|cover"),
    (lambda c: c.update(sizes=[6, 3]), "byte_range|cover"),
    (lambda c: c.update(file="../x.safetensors"), "rank_0.safetensors"),
    (lambda c: c.update(file="rank_1.safetensors"), "rank_0.safetensors"),
    (lambda c: c.update(byte_range=[0, 4]), "byte_range"),
    (lambda c: c.update(offsets="0"), "offsets"),
])
def test_version_2_metadata_is_checked(tmp_path, corrupt, match):
    meta = _v2(tmp_path)
    corrupt(meta["tensor_specs"]["w"]["chunks"][0])
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(MetadataError, match=match):
        ckpt.read_metadata(tmp_path)


def test_version_2_overlapping_chunks_are_refused(tmp_path):
    meta = _v2(tmp_path)
    meta["num_ranks"] = 2
    c = dict(meta["tensor_specs"]["w"]["chunks"][0], file="rank_1.safetensors")
    meta["tensor_specs"]["w"]["chunks"].append(c)
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(MetadataError, match="overlapping"):
        ckpt.read_metadata(tmp_path)


def _report(shape, boxes):
    return [{"w": (shape, "F32", o, s)} for o, s in boxes]


def test_plan_writes_each_distinct_box_once_spread_over_holders():
    # HSDP-like: ranks 0/2 and 1/3 hold the same halves
    reports = _report((8, 2), [((0, 0), (4, 2)), ((4, 0), (4, 2)), ((0, 0), (4, 2)), ((4, 0), (4, 2))])
    reports = [{**r, "v": ((6,), "F32", (0,), (6,))} for r in reports]
    plan = plan_chunks(reports, lambda d: 4)
    assert len(plan.tensors["w"].box_to_writer) == 2 and len(plan.tensors["v"].box_to_writer) == 1
    writers = [r for t in plan.tensors.values() for r in t.box_to_writer.values()]
    assert len(set(writers)) == 3


def test_plan_refuses_gaps_and_disagreement():
    with pytest.raises(TensorMismatchError, match="tile"):
        plan_chunks(_report((8,), [((0,), (4,)), ((5,), (3,))]), lambda d: 4)
    with pytest.raises(TensorMismatchError, match="on rank 1"):
        plan_chunks([{"w": ((8,), "F32", (0,), (8,))}, {"w": ((9,), "F32", (0,), (9,))}], lambda d: 4)
    with pytest.raises(TensorMismatchError, match="different tensors"):
        plan_chunks([{"w": ((8,), "F32", (0,), (8,))}, {}], lambda d: 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(1, 3), st.integers(1, 4))
def test_plan_covers_any_1d_split_once(sizes, cols, replicas):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    boxes = [((o, 0), (s, cols)) for o, s in zip(offsets, sizes)] * replicas
    plan = plan_chunks(_report((sum(sizes), cols), boxes), lambda d: 4)
    chosen = plan.tensors["w"].box_to_writer
    assert sum(b.numel for b in chosen) == sum(sizes) * cols
    assert all(boxes[r][0] == b.offsets for b, r in chosen.items())   # written by a rank holding it


def test_validate_checks_the_recorded_byte_ranges(tmp_path):
    ckpt.save({"w": W, "v": torch.ones(3)}, tmp_path)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    a, b = meta["tensor_specs"]["w"]["chunks"][0], meta["tensor_specs"]["v"]["chunks"][0]
    if a["byte_range"][0] < b["byte_range"][0]:
        a, b = b, a                      # shift the later entry onto the earlier one's bytes
    n = a["byte_range"][1] - a["byte_range"][0]
    a["byte_range"] = [b["byte_range"][0], b["byte_range"][0] + n]
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    report = ckpt.validate_distributed(tmp_path)
    assert not report.ok and "metadata.json records" in str(report)


def test_rank_state_round_trip_and_reserved_names(tmp_path):
    rng = {"torch": torch.get_rng_state(), "pos": 17}
    ckpt.save({"w": W}, tmp_path, rank_state=rng)
    restored = {"torch": torch.zeros_like(rng["torch"]), "pos": 0}
    target = {"w": torch.zeros(7, 3)}
    ckpt.load(target, tmp_path, rank_state=restored)          # strict: rank state is not "unexpected"
    assert torch.equal(restored["torch"], rng["torch"]) and restored["pos"] == 17
    ckpt.load(target, tmp_path)                               # without rank_state: ignored
    with pytest.raises(TensorMismatchError, match="reserved"):
        ckpt.save({"__rank_state__": {"x": W}}, tmp_path / "bad")
    assert ckpt.validate_distributed(tmp_path).ok
    assert set(ckpt.load_distributed(tmp_path, 0, 1)) >= {"w"}


def test_save_into_a_directory_being_written_fails_at_once_and_touches_nothing(tmp_path):
    from shardkit.errors import CheckpointBusyError
    from shardkit.storage import storage_for

    path = str(tmp_path / "ck")
    ckpt.save({"w": torch.arange(4.0)}, path)
    store, directory = storage_for(path)
    with store.writer_lock(directory, slot=0, holder="another job"):
        with pytest.raises(CheckpointBusyError, match="another job"):
            ckpt.save({"w": torch.zeros(4)}, path)
    state = {"w": torch.empty(4)}
    ckpt.load(state, path)
    assert torch.equal(state["w"], torch.arange(4.0))

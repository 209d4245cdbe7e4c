"""The pure planning of an HF export: who writes which whole tensor, which file, which rounds; which names."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import TensorMismatchError
from shardkit.hf.saving.export_plan import assign_writers, plan_export, select_model_names
from shardkit.hf.saving.gather import box_senders, rounds_of
from shardkit.hf.index import plan_shards
from shardkit.layout import Box

sizes_st = st.lists(st.integers(min_value=0, max_value=10_000), min_size=0, max_size=40)


def _named(sizes):
    return [(f"t{i}", b) for i, b in enumerate(sizes)]


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, world=st.integers(min_value=1, max_value=9), max_bytes=st.integers(min_value=1, max_value=30_000),
       safetensors=st.booleans())
def test_every_tensor_is_written_once_by_one_rank_in_files_within_the_limit(sizes, world, max_bytes, safetensors):
    name_bytes = _named(sizes)
    plan = plan_export(name_bytes, world, max_bytes, safetensors)
    written = [n for f in plan.files for n in f.names]
    assert sorted(written) == sorted(n for n, _ in name_bytes)          # each once
    assert set(plan.weight_map) == {n for n, _ in name_bytes}
    count = len(plan.files)
    ext = "safetensors" if safetensors else "bin"
    for number, f in enumerate(plan.files, start=1):
        assert re.fullmatch(rf"(model|pytorch_model)-{number:05d}-of-{count:05d}\.{ext}", f.name)
        assert 0 <= f.rank < world and f.names
        assert f.nbytes == sum(dict(name_bytes)[n] for n in f.names)
        assert f.nbytes <= max_bytes or len(f.names) == 1               # over the limit: one tensor alone
    assert [f.rank for f in plan.files] == sorted(f.rank for f in plan.files)  # rank 0's files first
    assert plan_export(name_bytes, world, max_bytes, safetensors) == plan     # every rank computes the same


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, world=st.integers(min_value=1, max_value=9))
def test_writers_are_balanced_by_bytes(sizes, world):
    name_bytes = _named(sizes)
    writer = assign_writers(name_bytes, world)
    loads = [sum(b for n, b in name_bytes if writer[n] == r) for r in range(world)]
    largest = max(sizes, default=0)
    assert max(loads) <= sum(sizes) / world + largest                # the greedy bound: never one rank's model
    if len(sizes) >= world and len(set(sizes)) == 1 and sizes[0] > 0:
        assert max(loads) - min(loads) <= sizes[0]                   # equal tensors: counts differ by at most one


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, max_bytes=st.integers(min_value=1, max_value=30_000))
def test_one_rank_cuts_as_the_forgather_planner_does(sizes, max_bytes):
    name_bytes = _named(sizes)
    assert [list(f.names) for f in plan_export(name_bytes, 1, max_bytes).files] == plan_shards(name_bytes, max_bytes)


def test_a_name_twice_is_refused():
    with pytest.raises(TensorMismatchError, match="more than once"):
        plan_export([("a", 1), ("a", 2)], 2, 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=6, unique=True), min_size=1, max_size=5))
def test_rounds_give_each_rank_its_names_in_order(sequences):
    rounds = rounds_of(sequences)
    for rank, seq in enumerate(sequences):
        assert [r[rank] for r in rounds if rank in r] == list(seq)
    assert len(rounds) == max(len(s) for s in sequences)


def test_box_senders_send_each_missing_box_once_and_spread_replicas():
    a, b, empty = Box((0, 0), (2, 4)), Box((2, 0), (2, 4)), Box((0, 0), (0, 4))
    # HSDP-like: ranks 0,2 hold a; ranks 1,3 hold b; rank 4 holds nothing
    boxes = [a, b, a, b, empty]
    assert box_senders(boxes, 0) == [(1, b)]
    assert box_senders(boxes, 2) == [(1, b)]
    assert box_senders(boxes, 1) == [(2, a)]
    assert box_senders(boxes, 3) == [(2, a)]
    assert box_senders(boxes, 4) == [(0, a), (1, b)]
    whole = Box((0, 0), (4, 4))
    assert box_senders([whole, whole], 1) == []                      # a replicated tensor: nothing moves


@pytest.mark.parametrize("names, prefix, expected", [
    # a training state: the model, stripped; optimizer moments and per-rank state left out
    (["model.w", "model.lm_head.weight", "optim.state.0.exp_avg", "__rank_state__.torch", "step"], None,
     {"model.w": "w", "model.lm_head.weight": "lm_head.weight"}),
    # a Hugging Face model's own names: kept whole
    (["model.embed", "lm_head.weight"], None, {"model.embed": "model.embed", "lm_head.weight": "lm_head.weight"}),
    # the same beside optimizer state: the optimizer goes, the names stay
    (["model.embed", "lm_head.weight", "optim.x"], None, {"model.embed": "model.embed",
                                                        "lm_head.weight": "lm_head.weight"}),
    # '' is everything as named
    (["model.w", "optim.x"], "", {"model.w": "model.w", "optim.x": "optim.x"}),
    (["model.w", "optim.x"], "model", {"model.w": "w"}),
    # nothing but training state: exported as named rather than nothing
    (["optim.x"], None, {"optim.x": "optim.x"}),
])
def test_select_model_names(names, prefix, expected):
    assert select_model_names(names, prefix) == expected


def test_select_model_names_refuses_a_prefix_nothing_is_under():
    with pytest.raises(TensorMismatchError, match="no tensor name starts with 'nope.'"):
        select_model_names(["model.w"], "nope")

"""storage.fast_io.destinations: which destination tensors share memory, so that no two parallel reads race on one byte."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import TensorMismatchError
from shardkit.storage.fast_io.destinations import check_disjoint, memory_identity, shared_destinations


def test_the_same_view_is_read_once_from_its_first_name():
    w = torch.zeros(4, 3)
    same, overlapping = shared_destinations({"embed": w, "other": torch.zeros(2), "lm_head": w.detach()})
    assert same == {"lm_head": "embed"} and overlapping == set()


def test_slices_that_overlap_are_reported_and_disjoint_ones_are_not():
    buf = torch.zeros(10)
    _, overlapping = shared_destinations({"a": buf[0:4], "b": buf[3:6], "c": buf[6:10]})
    assert overlapping == {"a", "b"}


def test_interleaved_views_count_as_overlapping():
    x = torch.zeros(4, 2)
    _, overlapping = shared_destinations({"even": x[:, 0], "odd": x[:, 1]})
    assert overlapping == {"even", "odd"}


def test_a_tensor_that_spans_others_marks_them_all():
    buf = torch.zeros(12)
    _, overlapping = shared_destinations({"all": buf, "x": buf[1:2], "y": buf[5:7], "z": torch.zeros(3)})
    assert overlapping == {"all", "x", "y"}


def test_meta_and_empty_tensors_share_nothing_unless_they_are_one_object():
    m = torch.empty(3, device="meta")
    e = torch.empty(0)
    same, overlapping = shared_destinations({"m": m, "m2": torch.empty(3, device="meta"), "m_again": m,
                                             "e": e, "e2": torch.empty(0, 5)})
    assert same == {"m_again": "m"} and overlapping == set()
    assert memory_identity(m) != memory_identity(torch.empty(3, device="meta"))


def test_check_disjoint_names_what_clashes():
    w = torch.zeros(4)
    with pytest.raises(TensorMismatchError, match="'b' and 'a' are the same memory"):
        check_disjoint({"a": w, "b": w}, "outputs")
    with pytest.raises(TensorMismatchError, match=r"\['a', 'b'\] overlap"):
        check_disjoint({"a": w[:3], "b": w[2:]}, "outputs")
    check_disjoint({"a": w[:2], "b": w[2:], "c": torch.zeros(0)}, "outputs")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 6)), min_size=1, max_size=6))
def test_overlap_agrees_with_comparing_every_pair(ranges):
    buf = torch.zeros(24)
    named = {f"t{i}": buf[start:start + n] for i, (start, n) in enumerate(ranges)}
    same, overlapping = shared_destinations(named)
    firsts = {n: t for n, t in named.items() if n not in same}
    expected = set()
    for (a, ta), (b, tb) in itertools.combinations(firsts.items(), 2):
        sa = set(range(ta.storage_offset(), ta.storage_offset() + ta.numel()))
        if sa & set(range(tb.storage_offset(), tb.storage_offset() + tb.numel())):
            expected |= {a, b}
    assert overlapping == expected
    for alias, first in same.items():
        assert memory_identity(named[alias]) == memory_identity(named[first])

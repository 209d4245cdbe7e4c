import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.layout import (
    cover_problem,
    Box,
    compute_shard_sizes,
    intersect,
    is_contiguous_box,
    overlapping_chunks,
    plan_box_reads,
    shard_box,
    shard_offsets,
)

FAST = settings(max_examples=60, deadline=None)


def test_compute_shard_sizes_matches_seed():
    assert compute_shard_sizes(12, 4) == [3, 3, 3, 3]
    assert compute_shard_sizes(10, 4) == [3, 3, 2, 2]
    assert compute_shard_sizes(0, 3) == [0, 0, 0]
    assert compute_shard_sizes(2, 5) == [1, 1, 0, 0, 0]


@pytest.mark.parametrize("n", [0, -1, 1.5])
def test_compute_shard_sizes_refuses_bad_parts(n):
    with pytest.raises(ValueError, match="num_parts"):
        compute_shard_sizes(4, n)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shard_sizes_sum_and_balance(total, n):
    sizes = compute_shard_sizes(total, n)
    assert sum(sizes) == total and len(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_shard_box_and_offsets():
    assert shard_offsets([3, 3, 2]) == [0, 3, 6]
    assert shard_box((8, 5), 1, [2, 3], 1) == Box((0, 2), (8, 3))
    assert shard_box((8, 5), None, [], 0) == Box((0, 0), (8, 5))


def test_intersect_and_overlap():
    assert intersect(Box((0,), (3,)), Box((3,), (2,))) is None
    assert intersect(Box((0, 0), (4, 4)), Box((2, 1), (5, 1))) == Box((2, 1), (2, 1))
    chunks = [Box((0,), (4,)), Box((4,), (4,)), Box((8,), (2,))]
    assert overlapping_chunks(chunks, Box((3,), (2,))) == [(0, Box((3,), (1,))), (1, Box((4,), (1,)))]


def test_contiguity():
    assert is_contiguous_box((4, 6), (1, 0), (2, 6))
    assert not is_contiguous_box((4, 6), (1, 0), (2, 3))
    assert is_contiguous_box((4, 6), (1, 2), (1, 3))
    assert is_contiguous_box((1, 4, 6), (0, 1, 0), (1, 2, 6))
    assert is_contiguous_box((4, 0), (0, 0), (4, 0))


def _apply(pieces, src, dst_shape):
    """Carry the plan out on flat numpy arrays, like the loader does with tensors."""
    dst = np.full(math.prod(dst_shape), -1, dtype=np.int64)
    flat_src = src.reshape(-1)
    for p in pieces:
        scratch = flat_src[p.src_start : p.src_start + p.src_numel].copy()
        view = np.lib.stride_tricks.as_strided(scratch, p.sizes, [s * 8 for s in p.src_strides])
        target = np.lib.stride_tricks.as_strided(dst[p.dst_start :], p.sizes, [s * 8 for s in p.dst_strides])
        target[...] = view
    return dst.reshape(dst_shape)


@st.composite
def box_cases(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    pad = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    return shape, offsets, sizes, pad, draw(st.integers(1, 80))


@FAST
@given(box_cases())
def test_plan_box_reads_copies_exactly_the_box(case):
    shape, offsets, sizes, pad, max_elems = case
    src = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    dst_shape = tuple(s + p for s, p in zip(sizes, pad))
    dst_off = tuple(p // 2 for p in pad)
    pieces = plan_box_reads(shape, offsets, dst_shape, dst_off, sizes, max_elems)
    out = _apply(pieces, src, dst_shape)
    want = src[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert np.array_equal(out[tuple(slice(o, o + s) for o, s in zip(dst_off, sizes))], want)
    assert (out == -1).sum() == math.prod(dst_shape) - math.prod(sizes)
    for p in pieces:
        assert p.direct or p.src_numel <= max(max_elems, 1)
        assert p.src_start + p.src_numel <= src.size


def test_contiguous_box_is_one_direct_read():
    pieces = plan_box_reads((10, 4), (3, 0), (5, 4), (0, 0), (5, 4), 1)
    assert len(pieces) == 1 and pieces[0].direct and pieces[0].src_start == 12 and pieces[0].src_numel == 20


def test_empty_box_plans_nothing():
    assert plan_box_reads((4, 0), (0, 0), (4, 0), (0, 0), (4, 0), 10) == []


@given(st.lists(st.integers(0, 5), min_size=0, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.tuples(*[st.integers(0, n) for n in shape]).flatmap(
                                lambda offs: st.tuples(st.just(offs),
                                                       st.tuples(*[st.integers(0, n - o)
                                                                   for n, o in zip(shape, offs)]))))))
def test_one_box_covers_exactly_when_it_is_the_whole_shape(case):
    shape, (offsets, sizes) = case
    problem = cover_problem(shape, [Box(offsets, sizes)])
    whole = math.prod(shape) == 0 and math.prod(sizes) == 0 or (tuple(offsets), tuple(sizes)) == (
        (0,) * len(shape), tuple(shape))
    assert (problem is None) == whole, (shape, offsets, sizes, problem)

"""check_cover: a version-2 tensor's chunks must cover it exactly, checked in time linear in the chunks."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.checkpoint.format.chunks import Chunk, check_cover
from shardkit.errors import MetadataError


def _chunk(i, offsets, sizes):
    return Chunk(f"rank_{i}.safetensors", tuple(offsets), tuple(sizes), 0, math.prod(sizes))


def _elementwise_exact_cover(shape, boxes) -> bool:
    """The reference: count every element (small shapes only)."""
    counts = dict.fromkeys(itertools.product(*(range(n) for n in shape)), 0)
    for offsets, sizes in boxes:
        for idx in itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))):
            if idx not in counts:
                return False
            counts[idx] += 1
    return all(c == 1 for c in counts.values())


@st.composite
def layouts(draw):
    """A shape and boxes in it: a grid split per dimension, then maybe one box moved or resized."""
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
    cuts = []
    for n in shape:
        inner = sorted(set(draw(st.lists(st.integers(0, n), max_size=3))))
        cuts.append(sorted({0, n, *inner}))
    boxes = [([c[i] for c, i in zip(cuts, cell)], [c[i + 1] - c[i] for c, i in zip(cuts, cell)])
             for cell in itertools.product(*(range(len(c) - 1) for c in cuts))]
    if boxes and draw(st.booleans()):
        k = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, ndim - 1))
        offsets, sizes = boxes[k]
        offsets, sizes = list(offsets), list(sizes)
        if draw(st.booleans()):
            offsets[d] = draw(st.integers(0, max(0, shape[d] - sizes[d])))
        else:
            sizes[d] = draw(st.integers(0, shape[d] - offsets[d]))
        boxes[k] = (offsets, sizes)
    if boxes and draw(st.booleans()):
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    return tuple(shape), boxes


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_check_cover_agrees_with_counting_every_element(layout):
    shape, boxes = layout
    chunks = [_chunk(i, o, s) for i, (o, s) in enumerate(boxes)]
    if _elementwise_exact_cover(shape, boxes):
        check_cover("w", shape, chunks, source="m")
    else:
        with pytest.raises(MetadataError):
            check_cover("w", shape, chunks, source="m")


def test_many_chunks_spanning_dim_0_are_checked_linearly():
    # Each chunk spans all of dim 0: a pairwise check would compare ~2 * 10**9 pairs.
    n = 1 << 16
    chunks = [_chunk(i, (0, i), (8, 1)) for i in range(n)]
    check_cover("w", (8, n), chunks, source="m")
    with pytest.raises(MetadataError, match="overlapping"):
        check_cover("w", (8, n), chunks[:-1] + [_chunk(n, (0, 0), (8, 1))], source="m")


def test_a_layout_that_is_no_grid_is_refused_without_enumerating_its_cells():
    # Staircase boxes: every chunk adds a cut in both dimensions, so the grid has ~n**2 cells.
    n = 4096
    chunks = [_chunk(i, (i, i), (1, 1)) for i in range(n)]
    with pytest.raises(MetadataError):
        check_cover("w", (n, n), chunks, source="m")

"""Property tests: random shapes (0-size dims too), shard dims, dtypes, N and M.

The M ranks' outputs put together equal the original bit for bit, and
load_region of a random box equals slicing. Small scratch and checksum
blocks are forced so that the scattered-read and block-verification paths
run on tiny tensors.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_helpers import bits_equal, join_ranks, save_full
from shardkit import knobs
from shardkit.checkpoint import compute_shard_sizes, load_distributed, load_region

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return ((raw % 2).bool() if dtype == torch.bool else raw.view(dtype)).reshape(shape)


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(0, ndim - 1))
    n, m = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    custom = draw(st.booleans())
    sizes = None
    if custom:  # arbitrary (not balanced) split, empty shards allowed
        cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=n - 1, max_size=n - 1)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [shape[dim]])]
    dtype = draw(st.sampled_from(DTYPES))
    box_off = tuple(draw(st.integers(0, s)) for s in shape)
    box_size = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, box_off))
    return shape, dim, n, m, sizes, dtype, box_off, box_size, draw(st.integers(0, 2**16))


@SETTINGS
@given(case=cases())
def test_n_to_m_bit_for_bit_and_regions(tmp_path_factory, monkeypatch, case):
    shape, dim, n, m, sizes, dtype, box_off, box_size, seed = case
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 24)
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 40)
    directory = tmp_path_factory.mktemp("prop")
    full = _tensor(shape, dtype, seed)
    rep = _tensor((3,), dtype, seed + 1)
    save_full({"w": full, "rep": rep}, directory, n, {"w": dim}, sizes={"w": sizes} if sizes else None)
    outs = [load_distributed(directory, r, m) for r in range(m)]
    expected = sizes if (sizes and m == n) else compute_shard_sizes(shape[dim], m)
    assert [o["w"].shape[dim] for o in outs] == list(expected)
    assert bits_equal(join_ranks([o["w"] for o in outs], dim), full)
    assert all(bits_equal(o["rep"], rep) for o in outs)
    region = load_region(directory, "w", box_off, box_size)
    assert bits_equal(region, full[tuple(slice(o, o + s) for o, s in zip(box_off, box_size))].contiguous())


@pytest.mark.parametrize("threads", [1, 4])
def test_threads_do_not_change_results(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(knobs, "IO_THREADS", threads)
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 256)
    full = _tensor((64, 33), torch.bfloat16, 5)
    save_full({"a": full, "b": full.t().contiguous()}, tmp_path, 4, {"a": 1, "b": 0})
    outs = [load_distributed(tmp_path, r, 3) for r in range(3)]
    assert bits_equal(torch.cat([o["a"] for o in outs], 1), full)
    assert bits_equal(torch.cat([o["b"] for o in outs], 0), full.t().contiguous())

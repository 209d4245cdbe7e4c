"""Pure planning: reduce ops per dtype, buckets, packing. No process group."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from shardkit.comm import ReduceOp
from shardkit.comm.buckets import pack, pack_bytes, plan_buckets, unpack, unpack_bytes
from shardkit.comm.reduce_op import coerce_op, plan_reduction
from shardkit.errors import CommArgumentError, UnsupportedOpError


def test_mean_is_an_alias_of_avg_and_names_are_accepted():
    assert ReduceOp.MEAN is ReduceOp.AVG
    assert coerce_op("mean") is ReduceOp.AVG and coerce_op("SUM") is ReduceOp.SUM
    with pytest.raises(CommArgumentError, match="unknown reduce op"):
        coerce_op("median")


def test_avg_plans():
    f = plan_reduction(ReduceOp.AVG, torch.float32, "gloo")
    assert (f.torch_op, f.post) == (dist.ReduceOp.SUM, "true_div")
    i = plan_reduction(ReduceOp.AVG, torch.int64, "gloo")
    assert (i.torch_op, i.post) == (dist.ReduceOp.SUM, "floor_div")
    assert plan_reduction(ReduceOp.AVG, torch.bfloat16, "nccl").torch_op == dist.ReduceOp.AVG


def test_narrow_avg_sums_wide_and_bool_sum_prod_are_logical():
    assert plan_reduction(ReduceOp.AVG, torch.int8, "gloo").wire_dtype == torch.int64
    assert plan_reduction(ReduceOp.AVG, torch.int32, "nccl").wire_dtype == torch.int64
    assert plan_reduction(ReduceOp.AVG, torch.float16, "gloo").wire_dtype == torch.float32
    assert plan_reduction(ReduceOp.AVG, torch.bfloat16, "nccl").wire_dtype == torch.bfloat16  # NCCL's own AVG
    assert plan_reduction(ReduceOp.SUM, torch.bool, "gloo").torch_op == dist.ReduceOp.MAX
    assert plan_reduction(ReduceOp.PROD, torch.bool, "nccl").torch_op == dist.ReduceOp.MIN


def test_int16_travels_as_int32_and_complex_as_real():
    assert plan_reduction(ReduceOp.SUM, torch.int16, "gloo").wire_dtype == torch.int32
    c = plan_reduction(ReduceOp.AVG, torch.complex64, "gloo")
    assert c.complex_view and c.wire_dtype == torch.float32 and c.post == "true_div"


@pytest.mark.parametrize("op,dtype,match", [
    (ReduceOp.AVG, torch.bool, "not defined for bool"),
    (ReduceOp.MAX, torch.complex64, "complex"),
    (ReduceOp.SUM, torch.uint16, "cannot reduce"),
])
def test_unsupported_combinations_are_refused(op, dtype, match):
    with pytest.raises(UnsupportedOpError, match=match):
        plan_reduction(op, dtype, "gloo")


def test_buckets_split_by_key_and_cap():
    assert plan_buckets([4, 4, 8], ["a", "b", "a"], 12) == [[0, 2], [1]]
    assert plan_buckets([8, 8, 8], ["a"] * 3, 12) == [[0], [1], [2]]
    assert plan_buckets([100], ["a"], 12) == [[0]]  # too big: a bucket of its own
    assert plan_buckets([4096] * 200, ["f32"] * 200, 32 << 20) == [list(range(200))]


@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from("abc")), max_size=40), st.integers(1, 120))
def test_buckets_cover_every_tensor_once_in_order(items, cap):
    sizes, keys = [s for s, _ in items], [k for _, k in items]
    buckets = plan_buckets(sizes, keys, cap)
    assert sorted(i for b in buckets for i in b) == list(range(len(items)))
    for b in buckets:
        assert b == sorted(b) and len({keys[i] for i in b}) == 1
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap


def test_pack_unpack_round_trip_including_non_contiguous():
    ts = [torch.arange(6.).reshape(2, 3).t(), torch.ones(()), torch.zeros(4)]
    flat = pack(ts)
    assert flat.numel() == 11
    flat.mul_(2)
    unpack(flat, ts)
    assert ts[0].tolist() == [[0, 6], [2, 8], [4, 10]] and ts[1].item() == 2
    lone = torch.ones(3)
    assert pack([lone]).data_ptr() == lone.data_ptr()  # no copy for one contiguous tensor


def test_pack_bytes_mixes_dtypes():
    ts = [torch.tensor([True, False]), torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([[7]], dtype=torch.int16)]
    flat = pack_bytes(ts)
    assert flat.dtype == torch.uint8 and flat.numel() == 2 + 2 + 2
    out = [torch.zeros_like(t) for t in ts]
    unpack_bytes(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(ts, out))

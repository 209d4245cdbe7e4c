"""Group.local: real Gloo ranks as threads of this process; collectives, ops, dtypes, errors."""

import threading
import time

import pytest
import torch

from comm_threads import on_threads
from shardkit import knobs
from shardkit.comm import Group, ReduceOp, UniqueId
from shardkit.errors import (CommAbortedError, CommArgumentError, CommError, CommTimeoutError,
                             InvalidRankError, UnsupportedOpError)

N = 3
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]


@pytest.fixture(scope="module")
def groups():
    gs = Group.local(N, timeout=20)
    yield gs
    for g in gs:
        g.close()


def _value(rank, dtype):
    # Values 1..3 and 0..2 per rank keep every op in range for int8/uint8.
    return torch.tensor([rank + 1, 2 - rank, rank % 2, 1], dtype=dtype)


def _expected(op, dtype):
    rows = torch.stack([_value(r, torch.float64) for r in range(N)])
    ref = {ReduceOp.SUM: rows.sum(0), ReduceOp.PROD: rows.prod(0), ReduceOp.MAX: rows.max(0).values,
           ReduceOp.MIN: rows.min(0).values}
    if op is ReduceOp.AVG:
        s = rows.sum(0)
        return s / N if dtype.is_floating_point else torch.div(s, N, rounding_mode="floor")
    return ref[op]


def test_every_op_on_every_main_dtype(groups):
    def body(g):
        out = {}
        for dtype in DTYPES:
            for op in ReduceOp:
                x = _value(g.rank, dtype)
                out[dtype, op] = (g.all_reduce(x, op), x)
        return out

    results = on_threads(groups, body)
    for (dtype, op), (got, x) in results[1].items():
        assert got.dtype == dtype
        assert torch.allclose(got.double(), _expected(op, dtype).to(dtype).double(), atol=1e-2), (dtype, op)
        assert torch.equal(x, _value(1, dtype))  # input untouched


def test_integer_avg_floors_toward_minus_infinity():
    gs = Group.local(2, timeout=10)
    got = on_threads(gs, lambda g: g.all_reduce(torch.tensor([[1, 1], [-2, -2]][g.rank]), ReduceOp.AVG))
    # ranks hold [1, 1] and [-2, -2]: sum -1, -1 // 2 == -1
    assert got[0].tolist() == [-1, -1] == got[1].tolist()


def test_bool_and_complex(groups):
    def body(g):
        b = torch.tensor([g.rank == 0, True, False])
        c = torch.tensor([1 + 1j * g.rank], dtype=torch.complex64)
        return (g.all_reduce(b, ReduceOp.MAX), g.all_reduce(b, ReduceOp.MIN),
                g.all_reduce(c, ReduceOp.SUM), g.all_reduce(c, ReduceOp.AVG))

    bmax, bmin, csum, cavg = on_threads(groups, body)[0]
    assert bmax.tolist() == [True, True, False] and bmin.tolist() == [False, True, False]
    assert csum.item() == 3 + 3j and cavg.item() == 1 + 1j


def test_all_reduce_in_place_coalesces_many_tensors_in_one_call(groups):
    class Counting:
        def __init__(self, pg):
            self.pg, self.calls = pg, 0

        def allreduce(self, *a):
            self.calls += 1
            return self.pg.allreduce(*a)

    def body(g):
        real = g._pg
        g._pg = counting = Counting(real)
        try:
            ts = [torch.full((1024,), float(g.rank)) for _ in range(200)]
            ts.append(torch.arange(6.).reshape(2, 3).t() * (g.rank + 1))  # non-contiguous
            ts.append(torch.full((2,), g.rank, dtype=torch.int64))        # second dtype: second bucket
            g.all_reduce_(ts, ReduceOp.SUM)
        finally:
            g._pg = real
        return ts, counting.calls

    (ts, calls), *_ = on_threads(groups, body)
    assert calls == 2  # one per dtype, not one per tensor
    assert all(t.eq(3.0).all() for t in ts[:200])
    assert ts[200].tolist() == (torch.arange(6.).reshape(2, 3).t() * 6).tolist()
    assert ts[201].tolist() == [3, 3]


def test_small_buckets_still_give_the_right_answer(groups, monkeypatch):
    monkeypatch.setattr(knobs, "COMM_BUCKET_BYTES", 64)
    got = on_threads(groups, lambda g: (g.all_reduce_(ts := [torch.ones(10) * g.rank for _ in range(5)], "avg"), ts)[1])
    assert all(t.eq(1.0).all() for t in got[2])


def test_broadcast_all_gather_reduce_scatter_barrier_send_recv(groups):
    def body(g):
        src = torch.tensor([[g.rank, 10 + g.rank]], dtype=torch.int16)
        b = g.broadcast(src, root=2)
        many = [torch.full((2,), g.rank, dtype=torch.bfloat16), torch.tensor([g.rank == 1])]
        g.broadcast_(many, root=1)
        gathered = g.all_gather(torch.full((2, 2), g.rank, dtype=torch.float64))
        rs = g.reduce_scatter(torch.arange(6) + g.rank, ReduceOp.MAX)
        g.barrier()
        got = torch.zeros(3)  # a chain 0 -> 1 -> 2, each adding its rank
        if g.rank > 0:
            g.recv(got, g.rank - 1)
        if g.rank < N - 1:
            g.send(got + g.rank + 1, g.rank + 1)
        return src, b, many, gathered, rs, got

    res = on_threads(groups, body)
    for r, (src, b, many, gathered, rs, got) in enumerate(res):
        assert src.tolist() == [[r, 10 + r]] and b.tolist() == [[2, 12]]
        assert many[0].tolist() == [1, 1] and many[1].tolist() == [True]
        assert [x[0, 0].item() for x in gathered] == [0, 1, 2]
        assert rs.tolist() == [2 * r + 2, 2 * r + 3]
    assert res[1][5].tolist() == [1, 1, 1] and res[2][5].tolist() == [3, 3, 3]


def test_all_gather_of_a_conjugate_or_negative_view_gathers_the_values_it_shows(groups):
    def body(g):
        z = torch.tensor([complex(g.rank, 1 + g.rank)], dtype=torch.complex64)
        x = torch.tensor([float(g.rank + 1)])
        return g.all_gather(z.conj()), g.all_gather(torch._neg_view(x))

    for zs, xs in on_threads(groups, body):
        assert [complex(z.item()) for z in zs] == [complex(r, -(1 + r)) for r in range(N)]
        assert [x.item() for x in xs] == [-(r + 1.0) for r in range(N)]


def test_split_gives_members_a_group_and_others_none(groups):
    def body(g):
        sub = g.split([2, 0])
        if sub is None:
            return None
        with sub:
            return sub.rank, sub.world_size, sub.all_reduce(torch.tensor([g.rank])).item()

    assert on_threads(groups, body) == [(1, 2, 2), None, (0, 2, 2)]


def test_disjoint_splits_at_once():
    gs = Group.local(4, timeout=20)
    got = on_threads(gs, lambda g: g.split([0, 1] if g.rank < 2 else [2, 3]).all_reduce(torch.tensor([g.rank])).item())
    assert got == [1, 1, 5, 5]


def test_world_size_one_needs_no_peers():
    (g,) = Group.local(1)
    assert g.all_reduce(torch.tensor([2.0]), ReduceOp.AVG).item() == 2.0
    assert g.all_gather(torch.ones(1))[0].item() == 1.0 and g.reduce_scatter(torch.ones(2)).tolist() == [1, 1]
    g.barrier()
    assert g.split([0]).world_size == 1
    with Group.init_rank(0, 1, UniqueId.new()) as solo:  # no network for a group of one
        assert solo.all_reduce(torch.ones(2)).tolist() == [1, 1]


@pytest.mark.parametrize("rank,world_size", [(2, 2), (-1, 2), (0, 0), (0, -3)])
def test_bad_rank_or_world_size(rank, world_size):
    with pytest.raises(InvalidRankError) as e:
        Group.init_rank(rank, world_size, UniqueId.new())
    assert "world_size" in str(e.value) and isinstance(e.value, ValueError)


def test_argument_errors(groups):
    g = groups[0]
    with pytest.raises(InvalidRankError, match="0..2"):
        g.broadcast(torch.ones(1), root=3)
    with pytest.raises(InvalidRankError, match="itself"):
        g.send(torch.ones(1), 0)
    with pytest.raises(InvalidRankError):
        g.recv(torch.ones(1), 7)
    with pytest.raises(CommArgumentError, match="divisible"):
        g.reduce_scatter(torch.ones(4))
    with pytest.raises(CommArgumentError, match="torch.Tensor"):
        g.all_reduce_([torch.ones(1), [1.0]])
    with pytest.raises(UnsupportedOpError, match="bool"):
        g.all_reduce(torch.ones(1, dtype=torch.bool), ReduceOp.AVG)
    with pytest.raises(InvalidRankError, match="repeats"):
        g.split([0, 0])
    with pytest.raises(CommArgumentError, match="timeout"):
        Group.local(1, timeout=-1)
    with pytest.raises(CommArgumentError, match="backend"):
        Group.local(1, backend="mpi")


def test_abort_from_watchdog_unblocks_a_stuck_collective():
    gs = Group.local(2, timeout=60)
    handle = gs[0].abort_handle()
    threading.Timer(0.3, handle.abort).start()
    t0 = time.monotonic()
    with pytest.raises(CommAbortedError):
        gs[0].all_reduce(torch.ones(4))  # rank 1 never joins
    assert time.monotonic() - t0 < 0.3 + 2.0
    assert handle.is_aborted
    handle.abort()  # idempotent
    with pytest.raises(CommAbortedError, match="aborted"):
        gs[0].barrier()
    assert gs[0].abort_handle() is handle


def test_abort_from_another_thread_during_send_recv():
    gs = Group.local(2, timeout=60)
    threading.Timer(0.3, gs[1].abort_handle().abort).start()
    with pytest.raises(CommAbortedError):
        gs[1].recv(torch.zeros(1), 0)  # nobody sends


def test_a_missing_peer_times_out_and_the_group_is_then_unusable():
    gs = Group.local(2, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError) as e:
        gs[0].all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 1 + knobs.COMM_TIMEOUT_SLACK_S + 5
    assert isinstance(e.value, TimeoutError)
    with pytest.raises(CommError, match="unusable"):
        gs[0].all_reduce(torch.ones(4))


def test_close_is_idempotent_and_refuses_more_work():
    (g,) = Group.local(1)
    with g:
        g.barrier()
    g.close()
    with pytest.raises(CommError, match="closed"):
        g.all_reduce(torch.ones(1))


def test_argument_check_turns_a_mismatch_into_a_clear_error(monkeypatch):
    monkeypatch.setattr(knobs, "COMM_CHECK_ARGS", True)
    gs = Group.local(2, timeout=20)

    def body(g):
        errors = []
        for call in (lambda: g.all_reduce_([torch.ones(2 + g.rank)]),
                     lambda: g.broadcast_([torch.ones(2)] * (1 + g.rank), root=0),
                     lambda: g.all_gather(torch.ones(1, dtype=[torch.float32, torch.int64][g.rank]))):
            try:
                call()
            except CommArgumentError as e:
                errors.append(str(e))
        g.all_reduce_([torch.ones(3)])  # matching calls still work with the check on
        return errors

    for errors in on_threads(gs, body):
        assert len(errors) == 3 and all("ranks [1]" in e for e in errors)


class _RefusingPG:
    """A process group whose every call fails as it is started, as NCCL's set-up can."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise RuntimeError("NCCL error: invalid usage; Duplicate GPU detected")
        return refuse


@pytest.mark.parametrize("call", [
    lambda g: g.all_reduce(torch.ones(2)),
    lambda g: g.broadcast_([torch.ones(2)], root=0),
    lambda g: g.all_gather(torch.ones(2)),
    lambda g: g.barrier(),
])
def test_a_backend_refusing_to_start_a_work_is_a_comm_error(call):
    (g,) = Group.local(1)
    real, g._pg = g._pg, _RefusingPG()
    try:
        with pytest.raises(CommError, match="could not start it.*Duplicate GPU"):
            call(g)
    finally:
        g._pg = real
        g.close()

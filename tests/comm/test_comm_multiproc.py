"""Real ranks in separate processes (Gloo over loopback): init_rank, from_env, torch interop, dead ranks.

Each spawned run batches many checks, because starting a process costs more
than all the collectives in it.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from comm_ranks import spawn_ranks
from shardkit.comm import Group, ReduceOp, UniqueId
from shardkit.errors import CommError

pytestmark = pytest.mark.multiproc

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]


def _value(rank, dtype):
    return torch.tensor([rank + 1, 3 - rank, rank % 2, 1], dtype=dtype)


def _battery(rank, world_size, uid_bytes):
    """Every collective, op and main dtype on one 4-rank group; returns a dict of results."""
    out = {}
    # Gloo named: "auto" would pick NCCL on a machine with a GPU, and this battery is Gloo's.
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), backend="gloo", timeout=30) as g:
        assert (g.rank, g.world_size, g.backend) == (rank, world_size, "gloo")
        for dtype in DTYPES:
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG):
                out["reduce", str(dtype), op.name] = g.all_reduce(_value(rank, dtype), op).tolist()
        out["bool_max"] = g.all_reduce(torch.tensor([rank == 3, False]), ReduceOp.MAX).tolist()
        # bools are logical: SUM is or, PROD is and (not bytes added: 4 ranks' True is 1, not 4)
        out["bool_sum"] = g.all_reduce(torch.tensor([True, False, rank == 0]), ReduceOp.SUM).view(torch.uint8).tolist()
        out["bool_prod"] = g.all_reduce(torch.tensor([True, rank != 0]), ReduceOp.PROD).view(torch.uint8).tolist()
        # AVG of narrow dtypes: the sum must not overflow before the division
        out["avg_wide"] = [g.all_reduce(torch.tensor(v, dtype=d), ReduceOp.AVG).tolist() for v, d in (
            ([100, -100], torch.int8), ([200], torch.uint8), ([30000], torch.int16), ([2**30 + rank], torch.int32),
            ([40000.0], torch.float16))]
        out["rs_avg_wide"] = g.reduce_scatter(torch.full((4,), 100, dtype=torch.int8), ReduceOp.AVG).tolist()
        many = [torch.full((1000,), float(rank)) for _ in range(50)] + [torch.tensor([rank], dtype=torch.int32)]
        g.all_reduce_(many, ReduceOp.AVG)
        out["many"] = (many[0][0].item(), many[49][-1].item(), many[50].item())
        b = [torch.full((2,), rank, dtype=torch.int64), torch.tensor([rank / 2], dtype=torch.bfloat16)]
        g.broadcast_(b, root=3)
        out["bcast"] = (b[0].tolist(), b[1].item(), g.broadcast(torch.tensor([rank]), root=1).item())
        out["gather"] = [t.item() for t in g.all_gather(torch.tensor(rank * 10))]
        out["rs"] = g.reduce_scatter(torch.arange(8.) * (rank + 1), ReduceOp.SUM).tolist()
        g.barrier()
        buf = torch.zeros(2)
        if rank == 0:
            g.send(torch.tensor([5.0, 6.0]), 3)
        elif rank == 3:
            g.recv(buf, 0)
        out["p2p"] = buf.tolist()
        odd = g.split([1, 3])
        out["split"] = None if odd is None else (odd.rank, odd.all_reduce(torch.tensor([rank])).item())
        # torch APIs accept the group: the first group of a process is torch's default group.
        t = torch.ones(2) * rank
        dist.all_reduce(t, group=g.process_group)
        out["torch"] = (t.tolist(), dist.get_rank(g.process_group), dist.get_world_size(g.process_group))
    return out


def test_four_ranks_every_collective_op_and_dtype(tmp_path):
    results = spawn_ranks(_battery, 4)
    rows = torch.stack([_value(r, torch.float64) for r in range(4)])
    for r, res in enumerate(results):
        for dtype in DTYPES:
            s = rows.sum(0)
            want = {"SUM": s, "PROD": rows.prod(0), "MAX": rows.max(0).values, "MIN": rows.min(0).values,
                    "AVG": s / 4 if dtype.is_floating_point else torch.div(s, 4, rounding_mode="floor")}
            for op, w in want.items():
                got = torch.tensor(res["reduce", str(dtype), op], dtype=torch.float64)
                assert torch.allclose(got, w.to(dtype).double(), atol=1e-2), (r, dtype, op)
        assert res["bool_max"] == [True, False]
        assert res["bool_sum"] == [1, 0, 1] and res["bool_prod"] == [1, 0]
        assert res["avg_wide"] == [[100, -100], [200], [30000], [2**30 + 1], [40000.0]]
        assert res["rs_avg_wide"] == [100]
        assert res["many"] == (1.5, 1.5, 1)  # int AVG: 6 // 4
        assert res["bcast"] == ([3, 3], 1.5, 1)
        assert res["gather"] == [0, 10, 20, 30]
        assert res["rs"] == [10 * (2 * r), 10 * (2 * r + 1)]
        assert res["p2p"] == ([5.0, 6.0] if r == 3 else [0.0, 0.0])
        assert res["split"] == ({1: (0, 4), 3: (1, 4)}.get(r))
        assert res["torch"] == ([6.0, 6.0], r, 4)


def _parameters_in_place(rank, world_size, uid_bytes):
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), timeout=30) as g:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        params = list(model.parameters())  # leaves that require grad: written in place, as torch's DDP does
        g.broadcast_(params, root=0)
        sent = [p.detach().clone() for p in params]
        for p in params:
            p.detach().add_(rank)
        g.all_reduce_(params, ReduceOp.AVG)
        out = torch.nn.Parameter(torch.zeros(2, 3).t())  # non-contiguous
        if rank == 0:
            g.send(torch.arange(6.).reshape(3, 2), 1)
        else:
            g.recv(out, 0)
        return [t.tolist() for t in sent], [p.tolist() for p in params], out.tolist(), all(p.requires_grad for p in params)


def test_broadcast_and_average_parameters_in_place():
    (sent0, avg0, _, grad0), (sent1, avg1, recv1, grad1) = spawn_ranks(_parameters_in_place, 2)
    assert sent0 == sent1 and avg0 == avg1 and grad0 and grad1
    assert torch.allclose(torch.cat([torch.tensor(p).flatten() for p in avg1]),
                          torch.cat([torch.tensor(p).flatten() for p in sent1]) + 0.5)
    assert recv1 == torch.arange(6.).reshape(3, 2).tolist()


def _from_env_and_ddp(rank, world_size, uid_bytes):
    uid = UniqueId.from_bytes(uid_bytes)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(uid.port))
    with Group.from_env(backend="gloo", timeout=30) as g:
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        model = torch.nn.Linear(4, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=g.process_group)
        ddp(torch.full((3, 4), float(rank + 1))).sum().backward()
        # Plain lists: tensors sent through the queue would need the exiting process alive.
        return (g.rank, [p.detach().tolist() for p in model.parameters()],
                [p.grad.tolist() for p in model.parameters()])


def test_from_env_and_torch_ddp_on_the_group(tmp_path):
    (r0, w0, g0), (r1, w1, g1) = spawn_ranks(_from_env_and_ddp, 2)
    assert (r0, r1) == (0, 1)
    assert w0 == w1  # DDP synchronised the weights
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b)) for a, b in zip(g0, g1))  # and averaged grads


def _from_env_twice_beside_torch(rank, world_size, uid_bytes):
    uid = UniqueId.from_bytes(uid_bytes)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(uid.port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)  # serves MASTER_PORT
    sums = []
    for step in range(2):  # a second group after the first is closed: same port, fresh keys
        with Group.from_env(backend="gloo", timeout=30) as g:
            sums.append(g.all_reduce(torch.tensor([rank + 1.0 + step])).item())
    dist.destroy_process_group()
    return sums


def test_from_env_beside_torch_s_own_env_group_and_twice_in_one_process():
    assert spawn_ranks(_from_env_twice_beside_torch, 2) == [[3.0, 5.0], [3.0, 5.0]]


def _die_mid_collective(rank, world_size, uid_bytes):
    g = Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), timeout=5)
    g.barrier()
    if rank == 2:
        time.sleep(0.5)  # let the others block in the collective first
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        g.all_reduce(torch.ones(1 << 20))
    except CommError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)
    return "no error", time.monotonic() - t0, ""


def test_a_killed_rank_makes_the_others_raise_within_the_timeout(tmp_path):
    results = spawn_ranks(_die_mid_collective, 3, may_die={2})
    for name, elapsed, msg in results[:2]:
        assert name in ("CommError", "CommTimeoutError"), (name, msg)
        assert elapsed < 5 + 2 + 10  # group timeout + shardkit's grace + a generous margin


def _join_alone(rank, world_size, uid_bytes, as_rank):
    # every rank but this one never comes: joining fails as a shardkit error, not torch's DistStoreError
    try:
        Group.init_rank(as_rank, 2, UniqueId.from_bytes(uid_bytes), timeout=2)
    except CommError as e:
        return type(e).__name__, "every rank was started" in str(e)
    return "joined", False


def test_a_rank_left_alone_at_the_rendezvous_gets_a_comm_error(tmp_path):
    # rank 0 hosting a store nobody joins; rank 1 finding no store (in separate runs: never meeting)
    assert spawn_ranks(_join_alone, 1, 0)[0] == ("CommTimeoutError", True)
    name, hint = spawn_ranks(_join_alone, 1, 1)[0]
    assert name in ("CommError", "CommTimeoutError") and hint

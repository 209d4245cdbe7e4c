"""CUDA checks for shardkit.comm: the NCCL path, the GPU-tensor rule for real, DeviceGroup.

Skipped without CUDA (tests/conftest.py). One GPU is enough for all but the
DeviceGroup collectives, which need two.
"""

import copy
import threading
import warnings

import pytest
import torch

from shardkit.comm import FALLBACK_ENV, DeviceGroup, GpuFallbackWarning, Group, ReduceOp
from shardkit.errors import InvalidRankError, UnsupportedOpError

pytestmark = pytest.mark.gpu
needs_nccl = pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="torch built without NCCL")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@needs_nccl
def test_nccl_single_rank_group_reduces_on_the_gpu():
    (g,) = Group.local(1, backend="nccl")
    t = torch.arange(4.0, device="cuda")
    out = g.all_reduce(t, ReduceOp.AVG)
    assert out.is_cuda and out.tolist() == [0, 1, 2, 3]
    ints = [torch.full((3,), 5, device="cuda", dtype=torch.int64), torch.ones(2, device="cuda")]
    stream = torch.cuda.Stream()
    g.all_reduce_(ints, ReduceOp.SUM, stream=stream)
    stream.synchronize()
    assert ints[0].tolist() == [5, 5, 5]
    g.broadcast_([t], root=0, stream=stream)
    assert [x.item() for x in g.all_gather(torch.tensor([7.0], device="cuda"))] == [7.0]
    g.barrier()
    # CPU tensors on an NCCL group go to its Gloo side.
    assert g.all_reduce(torch.ones(2)).tolist() == [1, 1]
    g.close()


def test_cuda_tensor_on_gloo_group_errors_naming_the_variable(monkeypatch):
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    (g,) = Group.local(1, backend="gloo")
    with pytest.raises(UnsupportedOpError, match=FALLBACK_ENV):
        g.all_reduce(torch.ones(2, device="cuda"))
    with pytest.raises(UnsupportedOpError, match=FALLBACK_ENV):
        g.broadcast_([torch.ones(2, device="cuda")], root=0)


def test_fallback_copies_through_host_and_warns_every_call(monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, "1")
    gs = Group.local(2, backend="gloo")
    results = [None, None]

    def rank(g):
        t = torch.full((3,), float(g.rank + 1), device="cuda")
        g.all_reduce_([t])
        g.all_reduce_([t])
        results[g.rank] = (t, g.all_gather(torch.tensor([g.rank], device="cuda")))

    # Recorded here, around both threads: catch_warnings swaps process-wide state,
    # so one per thread would lose the other thread's warnings.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        threads = [threading.Thread(target=rank, args=(g,)) for g in gs]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    t, gathered = results[0]
    assert t.is_cuda and t.tolist() == [6.0, 6.0, 6.0]
    assert [x.item() for x in gathered] == [0, 1] and gathered[0].is_cuda
    warned = [w for w in caught if issubclass(w.category, GpuFallbackWarning)]
    assert len(warned) == 6  # one per call on each rank, never deduplicated


@two_gpus
def test_device_group_all_reduce_broadcast_and_split():
    dg = DeviceGroup(["cuda:0", "cuda:1"])
    ts = [torch.full((4,), float(i + 1), device=f"cuda:{i}") for i in range(2)]
    streams = [torch.cuda.Stream(device=i) for i in range(2)]
    dg.all_reduce_(ts, ReduceOp.AVG, streams=streams)
    for s in streams:
        s.synchronize()
    assert [t.tolist() for t in ts] == [[1.5] * 4] * 2
    dg.broadcast_([torch.zeros(2, device="cuda:0"), torch.ones(2, device="cuda:1")], root=1)
    with pytest.raises(InvalidRankError):
        dg.broadcast_(ts, root=2)
    groups = dg.split()
    out = [None, None]

    def rank(g):
        out[g.rank] = g.all_reduce(torch.ones(2, device=f"cuda:{g.rank}")).tolist()

    threads = [threading.Thread(target=rank, args=(g,)) for g in groups]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert out == [[2, 2], [2, 2]]


@two_gpus
def test_device_group_broadcasts_dtypes_nccl_has_no_type_for():
    dg = DeviceGroup(["cuda:0", "cuda:1"])
    for dtype in (torch.int16, torch.uint16, torch.complex64, torch.bool, torch.float8_e4m3fn):
        src = torch.arange(6).to(dtype).reshape(2, 3)
        ts = [torch.zeros(2, 3, dtype=dtype, device="cuda:0"), src.to("cuda:1")]
        dg.broadcast_(ts, root=1)
        torch.cuda.synchronize("cuda:0")
        assert ts[0].cpu().view(torch.uint8).equal(src.view(torch.uint8)), dtype
    scalar = [torch.tensor(0.0, device="cuda:0"), torch.tensor(2.5, device="cuda:1")]
    dg.broadcast_(scalar, root=1)
    assert scalar[0].item() == 2.5


@needs_nccl
def test_ddp_on_a_one_rank_nccl_group_is_a_pass_through_on_the_gpu():
    # One rank: no hooks, no collective (a GPU test of the reductions needs two GPUs or
    # two processes: tests/gpu/test_ddp_gpu.py).
    from shardkit.ddp import DistributedDataParallel

    (g,) = Group.local(1, backend="nccl")
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
    model = DistributedDataParallel(copy.deepcopy(local), g)
    x = torch.randn(8, 32, device="cuda")
    local(x).square().sum().backward()
    model(x).square().sum().backward()
    for a, b in zip(local.parameters(), model.module.parameters()):
        assert b.grad.is_cuda and torch.allclose(a.grad, b.grad)
    g.close()


def _two_ranks_one_gpu(rank, world_size, uid_bytes):
    from shardkit.comm import UniqueId

    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), backend="nccl", timeout=30) as g:
        g.barrier()  # torch's NCCL barrier would put both ranks on one GPU: "Duplicate GPU detected"
        total = g.all_reduce(torch.tensor([rank + 1.0]))  # CPU tensors: the group's Gloo side
        g.barrier()
        return total.item()


@needs_nccl
def test_barrier_on_an_nccl_group_touches_no_gpu():
    from comm_ranks import spawn_ranks

    assert spawn_ranks(_two_ranks_one_gpu, 2) == [3.0, 3.0]

"""shardkit.ddp with CUDA models: gradients produced on a side stream are averaged after they exist.

Two ranks on one GPU can only share a Gloo group (NCCL refuses two ranks on one
device), so the reduction goes through the host fallback; what is under test is
the stream ordering of DDP's copies, not NCCL. The ranks are processes: as
threads of one process they would share autograd's one worker thread for the
device, and one rank's end of backward, waiting for the other's gradients,
would hold up the other's backward. Skipped without CUDA.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from comm_ranks import spawn_ranks

pytestmark = pytest.mark.gpu


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).cuda()


def _x(rank):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).cuda()


def _side_stream_backward(rank, world_size, uid_bytes):
    from shardkit.comm import FALLBACK_ENV, Group, UniqueId
    from shardkit.ddp import DistributedDataParallel

    os.environ[FALLBACK_ENV] = "1"
    warnings.simplefilter("ignore")
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), backend="gloo", timeout=60) as g:
        net = _net()
        ddp = DistributedDataParallel(net, g, bucket_cap_mb=4096 / 2**20)  # several buckets
        side = torch.cuda.Stream()
        x = _x(rank)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # the gradients appear late, on this stream only
            ddp(x).square().sum().backward()
        torch.cuda.current_stream().wait_stream(side)
        return [p.grad.cpu().tolist() for p in net.parameters()]


def test_gradients_from_a_side_stream_are_averaged_once_they_exist():
    g0, g1 = spawn_ranks(_side_stream_backward, 2)
    ref = _net()
    for r in range(2):
        (ref(_x(r)).square().sum() / 2).backward()
    for a, b, want in zip(g0, g1, ref.parameters()):
        assert a == b
        torch.testing.assert_close(torch.tensor(a), want.grad.cpu(), rtol=1e-5, atol=1e-5)

"""shardkit.ddp with CUDA models: gradients produced on a side stream are averaged after they exist.

Two ranks on one GPU can only share a Gloo group (NCCL refuses two ranks on one
device), so the reduction goes through the host fallback; what is under test is
the stream ordering of DDP's copies, not NCCL. Skipped without CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from comm_threads import on_threads
from shardkit.comm import FALLBACK_ENV, Group
from shardkit.ddp import DistributedDataParallel

pytestmark = pytest.mark.gpu


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).cuda()


def _x(rank):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).cuda()


def _side_stream_backward(group, nets):
    net = nets[group.rank]
    ddp = DistributedDataParallel(net, group, bucket_cap_mb=4096 / 2**20)  # several buckets
    side = torch.cuda.Stream()
    x = _x(group.rank)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the gradients appear late, on this stream only
        ddp(x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    return [p.grad.cpu() for p in net.parameters()]


def test_gradients_from_a_side_stream_are_averaged_once_they_exist(monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, "1")
    nets = [_net(), _net()]  # built here: rank threads must not share the RNG while seeding
    groups = Group.local(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g0, g1 = on_threads(groups, _side_stream_backward, nets)
    finally:
        for g in groups:
            g.close()
    ref = _net()
    for r in range(2):
        (ref(_x(r)).square().sum() / 2).backward()
    for a, b, want in zip(g0, g1, ref.parameters()):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, want.grad.cpu(), rtol=1e-5, atol=1e-5)

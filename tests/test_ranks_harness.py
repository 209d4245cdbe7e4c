import torch
import torch.distributed as dist

from ranks import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_run_ranks_all_reduce(tmp_path):
    assert run_ranks(_sum_ranks, 3, tmp_path) == [3.0, 3.0, 3.0]

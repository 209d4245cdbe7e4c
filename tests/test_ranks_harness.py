import torch
import torch.distributed as dist

from ranks import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_run_ranks_all_reduce(tmp_path):
    assert run_ranks(_sum_ranks, 3, tmp_path) == [3.0, 3.0, 3.0]


def _slow_rank_1_and_a_survivor(rank, world_size):
    import time

    if rank == 1:
        time.sleep(1.5)  # the may_die rank 2 returns first: rank 1's result must still be waited for
    return f"rank {rank}"


def test_a_may_die_rank_that_survives_never_costs_another_rank_its_result(tmp_path):
    from shardkit.launch import run_local_ranks

    got = run_local_ranks(_slow_rank_1_and_a_survivor, 3, init_default_group=False, may_die=(2,), timeout_s=60)
    assert got == ["rank 0", "rank 1", "rank 2"]


def _unpicklable_or_silent(rank, world_size):
    import os
    import threading

    if rank == 1:
        return threading.Lock()  # cannot be pickled: the queue's feeder would drop it silently
    if rank == 2:
        os._exit(0)  # exits "cleanly" without a result
    return rank


def test_a_rank_that_ends_without_a_result_fails_fast_not_at_the_timeout(tmp_path):
    import pytest

    from shardkit.launch import run_local_ranks

    with pytest.raises(RuntimeError, match=r"rank 1 failed:.*(pickle|lock)|exited without a result"):
        run_local_ranks(_unpicklable_or_silent, 3, init_default_group=False, timeout_s=600)  # not "did not finish"

"""The scale suite's workload, shared by its thread ranks (``scale_bench``) and process ranks
(``scale_processes``): each rank's state, where the steady saves go, and a checked load.

Not a benchmark by itself; it times only the load it checks. Example::

    shared, own = states(rank=3, tensors=32)
    seconds = load_checked(3, 32, "/tmp/scale/step")
"""

from __future__ import annotations

import time

__all__ = ["STEADY_SAVES", "steady_directories", "states", "load_checked"]


#: Saves after the first in each row: "save wall" is their median, "first save wall" the first's.
STEADY_SAVES = 3


def steady_directories(directory: str) -> list[str]:
    """Where a row's saves after the first go: one new directory each, beside ``directory``."""
    return [f"{directory}.steady{i}" for i in range(STEADY_SAVES)]


def states(rank: int, tensors: int):
    """One rank's state: ``tensors`` replicated tiny tensors and ``tensors`` of its own (its ``rank_state``)."""
    import torch

    shared = {f"model.w{i}": torch.arange(4, dtype=torch.float32) + i for i in range(tensors)}
    own = {f"shard{i}": torch.full((4,), float(rank * 1000 + i)) for i in range(tensors)}
    return shared, own


def load_checked(rank: int, tensors: int, directory: str, group=None) -> float:
    """Seconds for rank ``rank`` of ``group`` (None: the default process group) to load its part; checks the values."""
    import torch

    from shardkit.checkpoint import load

    shared, own = states(rank, tensors)
    zero_shared = {k: torch.zeros_like(v) for k, v in shared.items()}
    zero_own = {k: torch.zeros_like(v) for k, v in own.items()}
    start = time.perf_counter()
    load(zero_shared, directory, group=group, rank_state=zero_own)
    seconds = time.perf_counter() - start
    for got, want in ((zero_shared, shared), (zero_own, own)):
        for k in want:
            if not torch.equal(got[k], want[k]):
                raise AssertionError(f"rank {rank}: {k} loaded {got[k].tolist()}, saved {want[k].tolist()}")
    return seconds

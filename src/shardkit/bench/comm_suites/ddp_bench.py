"""DDP step: one SGD step of a small MLP on 2 Gloo ranks (processes).

Rows of the case ``DDP step 2 ranks MLP <params>``: ``shardkit`` (shardkit.ddp
on a ``comm.Group``), ``torch.nn.parallel.DistributedDataParallel`` (peer, on
the default process group ``run_local_ranks`` sets up) and the same model with
no communication (limit). Each timing is one step (forward, backward, optimizer
step, zero_grad), averaged over a block of steps; a rep's time is the slowest
rank's. What it does not measure: GPU, NCCL, or more than 2 ranks.

Example::

    from shardkit.bench.comm_suites.ddp_bench import run_ddp_benchmarks
    rows = run_ddp_benchmarks(reps=5)
"""

from __future__ import annotations

import statistics
import time

from shardkit.bench.common import row

WIDTH, DEPTH, BATCH = 1024, 3, 64   # ~2.4 M parameters, ~9 MiB of float32 gradients
STEPS_PER_REP, WARMUP_STEPS = 10, 3
IMPLS = ("shardkit", "torch.nn.parallel.DistributedDataParallel", "no communication")


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(256, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _wrap(impl, model, group):
    import torch

    from shardkit.ddp import DistributedDataParallel

    if impl == "shardkit":
        return DistributedDataParallel(model, group)
    if impl == "no communication":
        return model
    return torch.nn.parallel.DistributedDataParallel(model)  # default group: run_local_ranks made it


def _stepper(net, x, y):
    import torch

    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _rank(rank, world_size, uid_bytes, reps):
    """Per impl, this rank's seconds per step for every rep."""
    import torch
    import torch.distributed as dist

    from shardkit.comm import Group, UniqueId

    torch.set_num_threads(1)
    x = torch.randn(BATCH, 256, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(rank))
    out = {impl: [] for impl in IMPLS}
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), backend="gloo", timeout=300) as g:
        steps = {impl: _stepper(_wrap(impl, _model(), g), x, y) for impl in IMPLS}
        for impl in IMPLS:
            for _ in range(WARMUP_STEPS):
                steps[impl]()
        for _ in range(max(1, reps)):
            for impl in IMPLS:  # interleaved, so drift on the machine hits every row alike
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS_PER_REP):
                    steps[impl]()
                out[impl].append((time.perf_counter() - start) / STEPS_PER_REP)
    return out


def run_ddp_benchmarks(reps: int) -> list[dict]:
    """The ``DDP step`` rows: shardkit DDP, torch DDP (peer), no communication (limit)."""
    from shardkit.comm import UniqueId
    from shardkit.launch import run_local_ranks

    uid = UniqueId.new(host="127.0.0.1").as_bytes()
    per_rank = run_local_ranks(_rank, 2, uid, reps, init_default_group=False)
    n_params = sum(p.numel() for p in _model().parameters())
    case = f"DDP step 2 ranks MLP {n_params / 1e6:.1f}M params"
    rows = []
    for impl in IMPLS:
        slowest = [max(ts) for ts in zip(*(r[impl] for r in per_rank))]
        timing = {"median_s": statistics.median(slowest), "min_s": min(slowest), "max_s": max(slowest)}
        kind = {"shardkit": "ours", "no communication": "limit"}.get(impl, "peer")
        rows.append(row(case, impl, timing, kind=kind, bytes=n_params * 4))
    return rows


if __name__ == "__main__":
    import sys

    from shardkit.bench.common import format_table

    print(format_table(run_ddp_benchmarks(int(sys.argv[1]) if len(sys.argv) > 1 else 5)))

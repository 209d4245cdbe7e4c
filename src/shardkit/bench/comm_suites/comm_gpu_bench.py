"""GPU communication rows: an NCCL group's two wait modes next to ``torch.distributed``.

One process, one GPU, a one-rank NCCL group: what is measured is what a
call costs the host, not the wire (one rank moves nothing, and a DDP of one
rank is a pass-through, so no training step is timed here). Rows, each
timed over many back-to-back calls with a ``torch.cuda.synchronize()`` at
both ends, every implementation interleaved per repetition: at 16 B and at
64 MiB, ``Group.all_reduce_`` (stream-ordered, the default), the same group
built with ``knobs.COMM_NCCL_BLOCKING_WAIT`` (host wait), and
``torch.distributed.all_reduce`` on the same process group.

Needs CUDA and NCCL; ``python -m shardkit.bench --only comm-gpu``. Nothing here
asserts a time.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardkit import knobs
from shardkit.bench.common import row
from shardkit.comm import Group

MIB = 1024 * 1024
MIN_REPS = 5
_CALLS = {16: 2000, 64 * MIB: 50}


def _per_call_s(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def _groups() -> dict[str, Group]:
    saved = knobs.COMM_NCCL_BLOCKING_WAIT
    try:
        out = {}
        for impl, host_wait in (("shardkit", False), ("shardkit, COMM_NCCL_BLOCKING_WAIT", True)):
            knobs.COMM_NCCL_BLOCKING_WAIT = host_wait  # read when the group is built
            (out[impl],) = Group.local(1, backend="nccl")
        return out
    finally:
        knobs.COMM_NCCL_BLOCKING_WAIT = saved


def _kind(impl: str) -> str:
    return "ours" if impl == "shardkit" else "variant"


def _collective_cases(groups):
    torch_pg = groups["shardkit"].process_group
    for nbytes, calls in _CALLS.items():
        t = torch.ones(nbytes // 4, device="cuda")
        impls = {impl: (lambda g=g, t=t: g.all_reduce_([t]), _kind(impl)) for impl, g in groups.items()}
        impls["torch.distributed.all_reduce"] = (lambda t=t: dist.all_reduce(t, group=torch_pg), "peer")
        label = "16 B" if nbytes < MIB else f"{nbytes // MIB} MiB"
        yield f"NCCL all_reduce 1 rank {label}", impls, calls, nbytes


def run_comm_gpu_benchmarks(reps: int = MIN_REPS) -> list[dict]:
    """The rows above; raises ``RuntimeError`` without CUDA and NCCL."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("the comm-gpu suite needs a CUDA device and a torch build with NCCL")
    groups = _groups()
    rows = []
    try:
        for case, impls, calls, nbytes in _collective_cases(groups):
            for fn, _ in impls.values():
                _per_call_s(fn, 3)  # warm-up: communicator, allocator, kernels
            times = {impl: [] for impl in impls}
            for rep in range(max(MIN_REPS, reps)):
                order = list(impls.items())
                for impl, (fn, _) in order if rep % 2 == 0 else reversed(order):
                    times[impl].append(_per_call_s(fn, calls))
            for impl, (_, kind) in impls.items():
                ts = times[impl]
                timing = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
                rows.append(row(case, impl, timing, kind=kind, bytes=nbytes))
    finally:
        for g in groups.values():
            g.close()
    return rows

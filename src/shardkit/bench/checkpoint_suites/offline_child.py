"""One timed run of the offline suite, in the fresh process ``offline_bench`` starts for it.

A program of its own (``offline_bench`` names it in the ``python -c`` line it spawns, and never imports
it): it imports torch and the CLI, starts the clock, runs one command the way the ``shardkit`` command
does (``shardkit.cli.main([...])``) or DCP's peer, and reports seconds and its own peak memory. Not here:
building the source checkpoints, interleaving, the table (``offline_bench``).

Example (what ``offline_bench`` runs)::

    python -c "from shardkit.bench.checkpoint_suites.offline_child import run_kind; print(run_kind(...))"
"""

from __future__ import annotations

import os
import time

from shardkit.bench.checkpoint_suites.offline_bench import KINDS, N_TENSORS

__all__ = ["run_kind", "dcp_reshard3", "vmhwm_bytes"]


def dcp_reshard3(rank, world, src, dst, size_bytes):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = size_bytes // (N_TENSORS * 4096 * 4)
    state = {f"model.layers.{i}.w": distribute_tensor(torch.empty(rows, 4096), mesh, [Shard(0)])
             for i in range(N_TENSORS)}
    dcp.load(state, checkpoint_id=src)
    dcp.save(state, checkpoint_id=dst)
    return vmhwm_bytes()


def vmhwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_kind(kind: str, work: str, size_bytes: int) -> dict:
    """Run one command in this (fresh) process; its seconds and peak memory."""
    import resource

    import torch  # noqa: F401 -- imported before the clock, like every kind

    from shardkit.cli import main

    out = os.path.join(work, "out-" + kind)
    src_sk, src_dcp = os.path.join(work, "sk4"), os.path.join(work, "dcp4")
    start = time.perf_counter()
    if kind.startswith("baseline"):  # the imports the commands do, nothing else
        import shardkit.checkpoint, shardkit.hf, shardkit.offline, shardkit.sources  # noqa: F401,E401
        if kind == "baseline-dcp":
            import torch.distributed.checkpoint  # noqa: F401
    elif kind == "shardkit-reshard":
        assert main(["reshard", src_sk, out, "--world-size", "3", "--quiet"]) == 0
    elif kind == "dcp-load-save":
        from shardkit.launch import run_local_ranks
        ranks_peak_bytes = max(run_local_ranks(dcp_reshard3, 3, src_dcp, out, size_bytes))
    elif kind == "shardkit-convert-dcp":
        assert main(["convert", src_dcp, out, "--from", "dcp", "--to", "hf", "--prefix", "", "--quiet"]) == 0
    elif kind == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        os.makedirs(out)
        dcp_to_torch_save(src_dcp, os.path.join(out, "model.pt"))
    else:
        raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")
    seconds = time.perf_counter() - start
    if kind != "dcp-load-save":
        ranks_peak_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"seconds": seconds, "peak_bytes": vmhwm_bytes(), "children_peak_bytes": ranks_peak_bytes}

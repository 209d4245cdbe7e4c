"""Offline tools against DCP: ``reshard`` 4->3 vs dcp.load on 3 ranks + dcp.save; ``convert --from dcp`` vs ``dcp_to_torch_save``.

Each timed run is a fresh process (its peak RSS is reported too), the
implementations interleaved rep by rep. Run: ``python -m shardkit.bench.offline_bench 2GiB 3 /tmp/work``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch


def _state(size_bytes: int, n_tensors: int = 16) -> dict:
    rows = size_bytes // (n_tensors * 4096 * 4)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(rows, 4096, generator=g) for i in range(n_tensors)}


def _prepare(size_bytes: int, work: str) -> None:
    from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed
    from shardkit.launch import run_local_ranks

    state = _state(size_bytes)
    rows = next(iter(state.values())).shape[0]
    spec = ShardMetadata(4, {n: TensorShardSpec((rows, 4096), 0, (rows // 4,) * 4) for n in state})
    for r in reversed(range(4)):
        save_distributed({n: t[r * rows // 4:(r + 1) * rows // 4] for n, t in state.items()},
                         os.path.join(work, "sk4"), r, 4, spec)
    del state
    run_local_ranks(_dcp_save4, 4, os.path.join(work, "dcp4"), size_bytes)


def _dcp_save4(rank, world, path, size_bytes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in _state(size_bytes).items()}
    dcp.save(state, checkpoint_id=path)


def _dcp_reshard3(rank, world, src, dst, size_bytes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = size_bytes // (16 * 4096 * 4)
    state = {f"model.layers.{i}.w": distribute_tensor(torch.empty(rows, 4096), mesh, [Shard(0)]) for i in range(16)}
    dcp.load(state, checkpoint_id=src)
    dcp.save(state, checkpoint_id=dst)


def _child(kind: str, work: str, size_bytes: int) -> None:
    out = os.path.join(work, "out-" + kind)
    shutil.rmtree(out, ignore_errors=True)
    if kind == "shardkit-reshard":
        from shardkit.offline import reshard_checkpoint
        reshard_checkpoint(os.path.join(work, "sk4"), out, 3)
    elif kind == "dcp-load-save":
        from shardkit.launch import run_local_ranks
        run_local_ranks(_dcp_reshard3, 3, os.path.join(work, "dcp4"), out, size_bytes)
    elif kind == "shardkit-convert-dcp":
        from shardkit.offline import export_hf
        export_hf(os.path.join(work, "dcp4"), out, kind="dcp", prefix="")
    elif kind == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(os.path.join(work, "dcp4"), out + ".pt")
        os.remove(out + ".pt")
    shutil.rmtree(out, ignore_errors=True)


def _timed(kind: str, work: str, size_bytes: int) -> tuple[float, float]:
    code = ("import resource,sys,time; from shardkit.bench.offline_bench import _child; t=time.perf_counter(); "
            f"_child({kind!r}, {work!r}, {size_bytes}); print(time.perf_counter()-t, "
            "max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    seconds, rss_kib = out.stdout.split()[-2:]
    return float(seconds), int(rss_kib) / 1024


def main(size_bytes: int, reps: int, work: str) -> dict:
    os.makedirs(work, exist_ok=True)
    _prepare(size_bytes, work)
    kinds = ["shardkit-reshard", "dcp-load-save", "shardkit-convert-dcp", "dcp_to_torch_save"]
    results = {k: [] for k in kinds}
    for _ in range(reps):
        for k in kinds:
            results[k].append(_timed(k, work, size_bytes))
            print(k, results[k][-1], file=sys.stderr, flush=True)
    summary = {k: {"median_s": statistics.median(s for s, _ in v), "min_s": min(s for s, _ in v),
                   "max_s": max(s for s, _ in v), "peak_rss_mib": max(m for _, m in v)} for k, v in results.items()}
    summary["largest_tensor_mib"] = size_bytes / 16 / 2**20
    return summary


if __name__ == "__main__":
    from shardkit.bench.runner import _parse_size

    size = _parse_size(sys.argv[1] if len(sys.argv) > 1 else "2GiB")
    print(json.dumps(main(size, int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                          sys.argv[3] if len(sys.argv) > 3 else "/tmp/offline-bench"), indent=1))

"""Issue 30 row: a Hugging Face export from inside the job, shardkit vs DCP's HuggingFaceStorageWriter.

A state of fp32 DTensors sharded on dim 0 over 4 Gloo ranks (each rank
builds only its own shards: ``DTensor.from_local``), about ``--mib`` MiB in
all, exported as bf16 safetensors that ``from_pretrained`` reads:

- shardkit: ``shardkit.hf.save_checkpoint(dir, state, safetensors=True, dtype=torch.bfloat16)``
  (every rank writes whole tensors, gathered from their holders; fsync'd by
  default, and once more with ``sync_files=False``);
- DCP: ``dcp.save({k: v.to(torch.bfloat16)}, storage_writer=HuggingFaceStorageWriter(dir,
  save_distributed=True, enable_consolidation=True))``: per-rank shard files, then the
  consolidation into whole-tensor files (the cast is DCP's user's, so it is timed).

Every timed call starts after a barrier and ends with one: a time is the slowest
rank's. Each figure is the median of ``--reps`` runs (min and max shown). Both
outputs are checked to hold the same bf16 tensors once. Not a test: nothing here
asserts a time.

Run: ``shardkit bench --only hf-in-job --size 512MiB`` (rows in the side-by-side table), or
``python -m shardkit.bench.hf_suites.hf_in_job_bench --mib 512 --ranks 4 --workdir /fast/disk``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import zlib

import torch
import torch.distributed as dist

from shardkit.bench.common import barrier_timed
from shardkit.launch import run_local_ranks

#: (rows, cols) of the workload's matrices: a mix like ``docs/benchmarks.md``'s (large, medium, an embedding).
SHAPES = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 1024), (32000, 1024)]


def _shapes(total_mib: int) -> dict:
    out, total, i = {}, 0, 0
    while total < total_mib * 2**20:
        rows, cols = SHAPES[i % len(SHAPES)]
        out[f"layers.{i}.w"] = (rows, cols)
        total += rows * cols * 4
        i += 1
    out["norm.weight"] = (1024,)
    return out


def _state(shapes: dict, rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for name, shape in shapes.items():
        rows = shape[0]
        per = -(-rows // world_size)
        start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + rank)
        local = torch.randn((stop - start, *shape[1:]), generator=gen)
        stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                         stride=stride)
    return state


def _fresh(path: str) -> str:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def _rank(rank: int, world_size: int, total_mib: int, workdir: str, reps: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from shardkit.hf import save_checkpoint

    state = _state(_shapes(total_mib), rank, world_size)
    runs = {
        "shardkit save_checkpoint(dtype=bf16), fsync'd": lambda d: save_checkpoint(
            d, state, safetensors=True, dtype=torch.bfloat16),
        "shardkit save_checkpoint(dtype=bf16), no fsync": lambda d: save_checkpoint(
            d, state, safetensors=True, dtype=torch.bfloat16, sync_files=False),
        "dcp.save + HuggingFaceStorageWriter(save_distributed, consolidation)": lambda d: dcp.save(
            {k: v.to(torch.bfloat16) for k, v in state.items()},
            storage_writer=HuggingFaceStorageWriter(d, save_distributed=True, enable_consolidation=True)),
    }
    times: dict = {name: [] for name in runs}
    for _ in range(reps):
        for i, (name, run) in enumerate(runs.items()):
            times[name].append(barrier_timed(lambda: run(_fresh(os.path.join(workdir, f"out{i}")))))
    return times


def _same_output(workdir: str) -> bool:
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(d, name), "pt") as f:
                    out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    a, b = tensors(os.path.join(workdir, "out0")), tensors(os.path.join(workdir, "out2"))
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def run_hf_in_job_benchmarks(size_bytes: int, reps: int, workdir: str, ranks: int = 4) -> list[dict]:
    """``shardkit bench --only hf-in-job``: the export above of an fp32 state of about ``size_bytes`` on
    ``ranks`` Gloo ranks, ``reps`` runs of each; shardkit's fsync'd export is the ``shardkit`` row."""
    from shardkit.bench.common import row

    out = tempfile.mkdtemp(prefix="hf-in-job-", dir=workdir)
    mib = max(1, size_bytes // 2**20)
    try:
        times = run_local_ranks(_rank, ranks, mib, out, max(1, reps), timeout_s=3600)[0]
        if not _same_output(out):
            raise AssertionError("shardkit's and DCP's exports hold different tensors")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    case = f"HF export in the job, {ranks} ranks"
    # shardkit's export without fsync is its own variant, not a peer
    return [row(case, "shardkit" if name.endswith("fsync'd") else name,
                {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)},
                kind="peer" if name.startswith("dcp") else "variant")
            for name, ts in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="fp32 state size in MiB (default 512)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="hf-in-job-", dir=args.workdir)
    try:
        times = run_local_ranks(_rank, args.ranks, args.mib, workdir, args.reps, timeout_s=3600)[0]
        same = _same_output(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    dcp_name = next(n for n in times if n.startswith("dcp"))
    dcp_median = statistics.median(times[dcp_name])
    print(f"HF export in the job: {args.mib} MiB fp32 DTensor state -> bf16, {args.ranks} Gloo ranks, "
          f"median of {args.reps} (min..max), same tensors written: {same}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"  {name:<72} {median:7.2f} s ({min(ts):.2f}..{max(ts):.2f})  "
              f"x{dcp_median / median:.2f} vs DCP")


if __name__ == "__main__":
    main()

"""Multi-rank checkpoint rows: save on 4 ranks, reshard 4 -> 3 (time and peak memory).

Ranks are real processes on this machine with a Gloo process group
(``shardkit.launch.run_local_ranks``). Each rank builds only its own shard
of the workload. A timed repetition starts and ends with a barrier, so its
time is the slowest rank's. Each load case runs in fresh processes, and the
peak RSS a rank reports (``VmHWM``, reset just before the timed loads, minus
the RSS then) belongs to that case alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import zlib

import torch

from shardkit.bench.common import peak_rss, reset_peak_rss, row, with_env
from shardkit.bench.workload import tensor_shapes
from shardkit.checkpoint import ShardMetadata, TensorShardSpec, compute_shard_sizes, load_distributed, save_distributed
from shardkit.launch import run_local_ranks
from shardkit.storage import byte_view


def _spec(shapes: dict, world_size: int) -> ShardMetadata:
    specs = {
        name: TensorShardSpec(tuple(shape), 0, tuple(compute_shard_sizes(shape[0], world_size)))
        for name, shape in shapes.items()
        if len(shape) >= 1
    }
    return ShardMetadata(num_ranks=world_size, tensor_specs=specs)


def _local_state(shapes: dict, spec: ShardMetadata, rank: int) -> dict:
    state = {}
    for name, shape in shapes.items():
        s = spec.tensor_specs.get(name)
        local = list(shape)
        if s is not None:
            local[0] = s.shard_sizes[rank]
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
        state[name] = torch.randn(local, generator=gen).to(torch.bfloat16)
    return state


def _dtensor_state(local: dict, spec: ShardMetadata, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, t in local.items():
        s = spec.tensor_specs.get(name)
        if s is None:
            out[name] = t
        else:
            full = torch.Size(s.full_shape)
            out[name] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=full,
                                           stride=torch.empty(full, device="meta").stride())
    return out


def _timed(reps: int, fn, before=None) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _raw_rank_write(local: dict, path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"raw_{rank}.bin"), "wb", buffering=0) as f:
        for t in local.values():
            view = byte_view(t)
            for start in range(0, len(view), 16 << 20):
                f.write(view[start : start + (16 << 20)])
        os.fsync(f.fileno())


def _save_rank(rank, world_size, size_bytes, workdir, reps):
    """Save case: each impl `reps` times; the last checkpoint of each stays for the load cases."""
    import torch.distributed as dist

    from shardkit.bench import peers

    shapes = tensor_shapes(size_bytes)
    spec = _spec(shapes, world_size)
    local = _local_state(shapes, spec, rank)
    dstate = _dtensor_state(local, spec, world_size)
    paths = {k: os.path.join(workdir, f"ckpt{world_size}-{k}") for k in ("shardkit", "dcp", "raw")}

    def clear(key):
        def before():
            if rank == 0:
                shutil.rmtree(paths[key], ignore_errors=True)
                os.sync()
            dist.barrier()
        return before

    return {
        "shardkit": _timed(reps, lambda: save_distributed(local, paths["shardkit"], rank, world_size, spec,
                                                          group=dist.group.WORLD), clear("shardkit")),
        "dcp": _timed(reps, lambda: peers.dcp_save(dstate, paths["dcp"]), clear("dcp")),
        "raw": _timed(reps, lambda: _raw_rank_write(local, paths["raw"], rank), clear("raw")),
        "bytes": sum(t.numel() * t.element_size() for t in local.values()),
    }


def _seed_method(path: str, old_world: int, new_rank: int, new_world: int) -> dict:
    """The reference's reshard: load every old shard, concatenate, slice."""
    import json

    from safetensors.torch import load_file

    with open(os.path.join(path, "metadata.json")) as f:
        specs = json.load(f)["tensor_specs"]
    old = [load_file(os.path.join(path, f"rank_{r}.safetensors")) for r in range(old_world)]
    out = {}
    for name, s in specs.items():
        if s.get("shard_dim") is None:
            owner = next(o for o in old if name in o)
            out[name] = owner[name].clone()
            continue
        full = torch.cat([o[name] for o in old], dim=s["shard_dim"])
        sizes = compute_shard_sizes(full.shape[s["shard_dim"]], new_world)
        out[name] = full.narrow(s["shard_dim"], sum(sizes[:new_rank]), sizes[new_rank]).clone()
    return out


def _load_rank(rank, world_size, size_bytes, workdir, reps, impl, saved_world):
    from shardkit.bench import peers

    path = os.path.join(workdir, f"ckpt{saved_world}-{'dcp' if impl == 'dcp' else 'shardkit'}")
    if impl == "dcp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, empty

        mesh = init_device_mesh("cpu", (world_size,))
        shapes = tensor_shapes(size_bytes)
        def load():  # the destination is allocated inside, as every other impl's output is
            template = {n: (empty(s, device_mesh=mesh, placements=[Shard(0)], dtype=torch.bfloat16) if len(s)
                            else torch.empty(s, dtype=torch.bfloat16)) for n, s in shapes.items()}
            return peers.dcp_load(template, path)
    elif impl == "seed":
        load = lambda: _seed_method(path, saved_world, rank, world_size)  # noqa: E731
    else:
        load = lambda: load_distributed(path, rank, world_size)  # noqa: E731
    out = load()  # warm cache; also the output size
    out_bytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in out.values())
    del out
    baseline = reset_peak_rss()
    times = _timed(reps, load)
    return {"times": times, "peak_extra": max(0, peak_rss() - baseline), "out_bytes": out_bytes}


def _agg(per_rank_times: list[list[float]]) -> dict:
    slowest = [max(ts) for ts in zip(*per_rank_times)]
    return {"median_s": statistics.median(slowest), "min_s": min(slowest), "max_s": max(slowest)}


def run_multirank_benchmarks(size_bytes: int, reps: int, workdir: str, old_world=4, new_world=3) -> list[dict]:
    rows = []
    saved = run_local_ranks(_save_rank, old_world, size_bytes, workdir, reps, workdir=workdir)
    total = sum(r["bytes"] for r in saved)
    case = f"save, {old_world} ranks, fsync'd"
    for key, impl, kind in (("shardkit", "shardkit", "peer"), ("dcp", "torch.distributed.checkpoint.save", "peer"),
                            ("raw", "raw parallel write + fsync (limit)", "limit")):
        rows.append(row(case, impl, _agg([r[key] for r in saved]), kind=kind, bytes=total))
    run_local_ranks(_save_rank, new_world, size_bytes, workdir, 1, workdir=workdir)  # for the limit row
    case = f"reshard {old_world} -> {new_world}, per loading rank"
    for impl, name, saved_world, kind in (
        ("shardkit", "shardkit", old_world, "peer"),
        ("dcp", "torch.distributed.checkpoint.load", old_world, "peer"),
        ("seed", "seed method (load all, concat, slice)", old_world, "peer"),
        ("shardkit", f"same-world-size load {new_world} -> {new_world} (limit)", new_world, "limit"),
    ):
        res = with_env({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}, run_local_ranks, _load_rank, new_world,
                        size_bytes, workdir, reps, impl, saved_world, workdir=workdir)
        worst = max(res, key=lambda r: r["peak_extra"])
        rows.append(row(case, name, _agg([r["times"] for r in res]), kind=kind,
                        bytes=sum(r["out_bytes"] for r in res), peak_bytes=worst["peak_extra"],
                        out_bytes=worst["out_bytes"]))
    for sub in os.listdir(workdir):
        if sub.startswith("ckpt"):
            shutil.rmtree(os.path.join(workdir, sub), ignore_errors=True)
    return rows

"""FSDP2 rows (issue 11): shardkit.checkpoint.save / load / async_save vs torch.distributed.checkpoint.

The state of an FSDP2 model (``fully_shard`` on a CPU mesh, Gloo) with Adam:
model + two moments, about ``--mib`` MiB in all, on 4 ranks. Rows:

- save on 4 ranks: ``shardkit.checkpoint.save`` vs ``dcp.save`` (both fsync their files);
- load 4 -> 3: into FSDP2 on 3 fresh ranks, time and each rank's peak RSS above
  its RSS before the load (``VmHWM`` after a reset), per implementation in its own spawn;
- async_save on 4 ranks: the time the call blocks, shardkit vs ``dcp.async_save``
  (DCP given a dedicated Gloo group, as torchtitan does; shardkit makes its own).

Every timed call starts after a barrier and ends with one, so a time is the slowest rank's.
Run: ``shardkit bench --only fsdp2 --size 1GiB`` (rows in the side-by-side table, ``--reps`` runs each), or
``python -m shardkit.bench.checkpoint_suites.dtensor_bench --mib 1024 --workdir /fast/disk`` (one run, printed).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from shardkit.bench.common import barrier_timed, peak_rss, reset_peak_rss, row
from shardkit.launch import run_local_ranks


def _model(total_mib: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # params are a third of the state (Adam keeps two moments); 1023 x 1023 layers shard unevenly on 3 and 4 ranks
    per_layer = 1023 * 1023 * 4
    layers = max(1, total_mib * 2**20 // 3 // per_layer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1023, 1023) for _ in range(layers)])
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def _state(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": 1}


def _save_ranks(rank, world_size, total_mib, root):
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint as ckpt

    model, optim = _model(total_mib, world_size)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    get_state_dict(model, optim)      # creates Adam's state
    state = _state(model, optim)
    out = {"shardkit save": barrier_timed(lambda: ckpt.save(state, f"{root}/sk")),
           "dcp.save": barrier_timed(lambda: dcp.save(state, checkpoint_id=f"{root}/dcp"))}
    gloo = dist.new_group(backend="gloo")
    ckpt.async_save(state, f"{root}/sk_async_warm").wait()           # makes its background group
    dist.barrier()
    t0 = time.perf_counter()
    f = ckpt.async_save(state, f"{root}/sk_async")
    out["shardkit async_save (blocking)"] = time.perf_counter() - t0
    f.wait()
    dist.barrier()
    t0 = time.perf_counter()
    f = dcp.async_save(state, checkpoint_id=f"{root}/dcp_async", process_group=gloo)
    out["dcp.async_save (blocking)"] = time.perf_counter() - t0
    f.result()
    dist.barrier()
    out["state_bytes"] = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
                             for t in _leaves(state))
    return out


def _leaves(sd):
    from shardkit.checkpoint.loading.load_into import state_leaves as leaves

    return list(leaves(sd)[0].values())


def _load_ranks(rank, world_size, total_mib, root, impl):
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint as ckpt

    model, optim = _model(total_mib, world_size)
    state = _state(model, optim)
    out_bytes = sum(t.to_local().numel() * t.element_size() for t in _leaves(state) if hasattr(t, "to_local"))
    before = reset_peak_rss()
    if impl == "shardkit":
        seconds = barrier_timed(lambda: ckpt.load(state, f"{root}/sk"))
    else:
        seconds = barrier_timed(lambda: dcp.load(state, checkpoint_id=f"{root}/dcp"))
    return {"seconds": seconds, "peak_extra": peak_rss() - before, "out_bytes": out_bytes}


#: (case, shardkit's key, the peer's key) of the save rows ``_save_ranks`` times.
SAVE_CASES = (("FSDP2 save, 4 ranks", "shardkit save", "dcp.save"),
              ("FSDP2 async_save blocking, 4 ranks", "shardkit async_save (blocking)", "dcp.async_save (blocking)"))


def _timing(seconds: list[float]) -> dict:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def run_dtensor_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    """``shardkit bench --only fsdp2``: the rows above for an FSDP2 + Adam state of about ``size_bytes``,
    each figure over ``reps`` runs (a run: save on 4 ranks, then load 4 -> 3 with each implementation)."""
    mib = max(1, size_bytes // 2**20)
    times: dict[tuple[str, str], list[float]] = {}
    peaks: dict[str, list[int]] = {"shardkit": [], "dcp": []}
    state_bytes = out_bytes = 0
    for _ in range(max(1, reps)):
        root = tempfile.mkdtemp(prefix="shardkit-dtensor-bench-", dir=workdir)
        try:
            saved = run_local_ranks(_save_ranks, 4, mib, root, timeout_s=1800)
            state_bytes = sum(r["state_bytes"] for r in saved)
            for case, ours, peer in SAVE_CASES:
                times.setdefault((case, "shardkit"), []).append(max(r[ours] for r in saved))
                times.setdefault((case, peer), []).append(max(r[peer] for r in saved))
            for impl in ("shardkit", "dcp"):
                loads = run_local_ranks(_load_ranks, 3, mib, root, impl, timeout_s=1800)
                times.setdefault(("FSDP2 load 4 -> 3 ranks", impl if impl == "shardkit" else "dcp.load"),
                                 []).append(max(r["seconds"] for r in loads))
                peaks[impl].append(max(r["peak_extra"] for r in loads))
                out_bytes = max(r["out_bytes"] for r in loads)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (case, impl), seconds in times.items():
        extra = {"bytes": state_bytes}
        if case.startswith("FSDP2 load"):
            extra.update(peak_bytes=max(peaks["shardkit" if impl == "shardkit" else "dcp"]), out_bytes=out_bytes)
        rows.append(row(case, impl, _timing(seconds), kind="peer", **extra))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardkit-dtensor-bench-", dir=args.workdir)
    try:
        saved = run_local_ranks(_save_ranks, 4, args.mib, root, timeout_s=1800)
        total = sum(r["state_bytes"] for r in saved)
        print(f"FSDP2 + Adam state: {total / 2**20:.0f} MiB on 4 ranks")
        for key in ("shardkit save", "dcp.save", "shardkit async_save (blocking)", "dcp.async_save (blocking)"):
            print(f"  {key:<34} {max(r[key] for r in saved):8.3f} s")
        for impl in ("shardkit", "dcp"):
            loads = run_local_ranks(_load_ranks, 3, args.mib, root, impl, timeout_s=1800)
            peak = max(r["peak_extra"] for r in loads) / 2**20
            out = max(r["out_bytes"] for r in loads) / 2**20
            print(f"  load 4->3 {impl:<24} {max(r['seconds'] for r in loads):8.3f} s   "
                  f"peak extra per rank {peak:.0f} MiB (output {out:.0f} MiB)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

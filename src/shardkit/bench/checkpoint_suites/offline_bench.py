"""Offline tools against DCP: ``shardkit reshard`` 4->3 vs ``dcp.load`` on 3 ranks + ``dcp.save``;
``shardkit convert --from dcp`` vs DCP's own ``dcp_to_torch_save``.

How it measures (``shardkit bench --only offline`` or
``python -m shardkit.bench.checkpoint_suites.offline_bench 2GiB 3 /tmp/work [kind,kind]``, the
last argument choosing among ``KINDS``):

- the source checkpoints (a shardkit one saved by 4 ranks with
  ``save_distributed``, so format version 3, a DCP one saved by 4 Gloo ranks;
  16 float32 tensors) are built by a separate earlier process,
  so no measured process inherits the memory that built them;
- every timed run is a fresh process that imports torch and the CLI, then
  starts the clock and runs the command (``shardkit.cli.main([...])``, the
  code the ``shardkit`` command runs; DCP's functions for the peers), and
  reports its own peak resident memory, ``VmHWM`` from ``/proc/self/status``
  (the kernel's high-water mark of this process's memory since its ``exec``:
  nothing of the parent's counts). A baseline process that only does the
  imports gives the memory the command itself added;
- the implementations run interleaved, rep by rep, order reversed every other
  rep; the figures are median, min and max. Page cache warm (same files every rep).

For ``dcp.load + dcp.save`` (3 rank processes, forked by a forkserver) the
peak is the largest rank's own ``VmHWM``, which includes the pages a rank
shared with the forkserver at its start: an upper bound, for information only.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

KINDS = ("shardkit-reshard", "dcp-load-save", "shardkit-convert-dcp", "dcp_to_torch_save")
N_TENSORS = 16


def _state(size_bytes: int) -> dict:
    import torch

    rows = size_bytes // (N_TENSORS * 4096 * 4)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(rows, 4096, generator=g) for i in range(N_TENSORS)}


def prepare(size_bytes: int, work: str) -> None:
    """Build ``work/sk4`` (shardkit, 4 ranks) and ``work/dcp4`` (DCP, 4 ranks) unless present."""
    from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed
    from shardkit.launch import run_local_ranks

    os.makedirs(work, exist_ok=True)
    stamp = os.path.join(work, f"prepared-{size_bytes}")
    if os.path.exists(stamp):
        return
    for d in ("sk4", "dcp4"):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    state = _state(size_bytes)
    rows = next(iter(state.values())).shape[0]
    spec = ShardMetadata(4, {n: TensorShardSpec((rows, 4096), 0, (rows // 4,) * 4) for n in state})
    for r in reversed(range(4)):
        save_distributed({n: t[r * rows // 4:(r + 1) * rows // 4] for n, t in state.items()},
                         os.path.join(work, "sk4"), r, 4, spec)
    del state
    run_local_ranks(_dcp_save4, 4, os.path.join(work, "dcp4"), size_bytes)
    open(stamp, "w").close()


def _dcp_save4(rank, world, path, size_bytes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in _state(size_bytes).items()}
    dcp.save(state, checkpoint_id=path)


def _timed(kind: str, work: str, size_bytes: int) -> dict:
    shutil.rmtree(os.path.join(work, "out-" + kind), ignore_errors=True)
    code = ("import json, sys; from shardkit.bench.checkpoint_suites.offline_child import run_kind; "
            f"print('RESULT ' + json.dumps(run_kind({kind!r}, {work!r}, {size_bytes})))")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    shutil.rmtree(os.path.join(work, "out-" + kind), ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def measure(size_bytes: int, reps: int, work: str, kinds=KINDS) -> dict:
    """``kind -> {"seconds": [...], "peak_bytes": [...], ...}`` and the baseline, interleaved over ``reps``."""
    subprocess.run([sys.executable, "-W", "ignore", "-c",
                    f"from shardkit.bench.checkpoint_suites.offline_bench import prepare; prepare({size_bytes}, {work!r})"],
                   check=True)
    results = {k: [] for k in kinds}
    for rep in range(max(1, reps)):
        for k in (list(kinds)[::-1] if rep % 2 else kinds):
            results[k].append(_timed(k, work, size_bytes))
            print(f"offline bench rep {rep}: {k} {results[k][-1]}", file=sys.stderr, flush=True)
    baselines = {k: _timed(k, work, size_bytes)["peak_bytes"] for k in ("baseline", "baseline-dcp")}
    return {"baseline_peak_bytes": baselines["baseline"], "baseline_dcp_peak_bytes": baselines["baseline-dcp"],
            "runs": results}


def rows_of(measured: dict, size_bytes: int) -> list[dict]:
    """The bench table's rows: case, impl, median/min/max seconds, peak memory above the import baseline."""
    from shardkit.bench.common import row

    runs = measured["runs"]

    def timing(kind):
        ts = [r["seconds"] for r in runs[kind]]
        return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}

    def base(kind):  # the DCP kinds import torch.distributed.checkpoint; the reshard ones do not
        dcp = kind != "shardkit-reshard"
        return measured.get("baseline_dcp_peak_bytes" if dcp else "baseline_peak_bytes", 0)

    def peak(kind):
        return max(max(r["peak_bytes"], r["children_peak_bytes"]) for r in runs[kind]) - base(kind)

    largest = size_bytes // N_TENSORS
    out = []
    for case, ours, peer, note in (
            ("offline reshard 4->3", "shardkit-reshard", "dcp-load-save", "dcp.load on 3 ranks + dcp.save"),
            ("offline convert --from dcp", "shardkit-convert-dcp", "dcp_to_torch_save", "dcp_to_torch_save")):
        if ours in runs:
            out.append(row(case, "shardkit", timing(ours), bytes=size_bytes, peak_bytes=peak(ours),
                           largest_tensor_bytes=largest, baseline_bytes=base(ours),
                           peak_abs_bytes=max(r["peak_bytes"] for r in runs[ours])))
        if peer in runs:
            out.append(row(case, note, timing(peer), bytes=size_bytes, peak_bytes=peak(peer)))
    return out


def run_offline_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    """The ``offline`` suite of ``shardkit bench``."""
    return rows_of(measure(size_bytes, reps, os.path.join(workdir, "offline")), size_bytes)


if __name__ == "__main__":
    from shardkit.bench.common import format_table
    from shardkit.sizes import size_bytes

    size = size_bytes(sys.argv[1] if len(sys.argv) > 1 else "2GiB")
    work = sys.argv[3] if len(sys.argv) > 3 else "/tmp/offline-bench"
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else KINDS   # e.g. shardkit-reshard,dcp-load-save
    measured = measure(size, int(sys.argv[2]) if len(sys.argv) > 2 else 3, work, kinds=only)
    rows = rows_of(measured, size)
    print(format_table(rows))
    print(json.dumps({"measured": measured, "rows": rows}, indent=1))

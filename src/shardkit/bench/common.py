"""Shared pieces of the benchmarks: timing, rows, the side-by-side table.

A row is a plain dict: ``{"case", "impl", "median_s", "min_s", "max_s"}`` and
optionally ``"bytes"`` (work size, for GB/s), ``"peak_bytes"`` (memory above
baseline), ``"note"``. Within a case, the row whose impl is ``"shardkit"`` is
compared with every other row; ``kind`` marks the comparison rows as
``"peer"`` or ``"limit"`` (the physical bound).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable

from shardkit.storage.json_io import gc_paused
from shardkit.storage.fast_io.map_prefetch import wait_for_prefetch


#: Cases whose runs swing with the VM's page-fault speed far more than the
#: effect they measure (a 3-40 ms dict load, a 1 GiB save into the page cache:
#: 0.3-0.4 s, and 1-3 s in one run out of three or four, whichever tool
#: saves; a steady-state ``save_async``, one 0.06-0.10 s copy of the state)
#: run at least this many times whatever ``reps`` says: one hiccup moves a
#: median of 3 by up to 2x, two of them by 5x.
NOISY_MIN_REPS = 11

#: The verified-against-unverified loads: fresh, two 0.2-0.5 s loads into
#: fresh memory per rep, whose spread within one run (up to 2.5x) dwarfs the
#: 2-5% that hashing costs (11 reps put the ratio's median anywhere in
#: 1.03-1.12); in place, 0.08-0.10 s loads whose ratio read 1.03-1.12 at 11
#: reps, and 1.04-1.14 between two pairs of the same loads in one run.
VERIFY_MIN_REPS = 21

#: The first background save runs in a new process per sample (~10 s each):
#: at least this many samples per impl, as one slow-memory minute on the VM
#: moved a single sample from 0.8 to 1.8 s.
FIRST_CALL_MIN_REPS = 5


# The garbage collector is off while a run is timed (``gc_paused``), as ``timeit`` does. The bench
# process holds many objects (transformers, the models built so far): a full collection of it took
# 0.18 s, against 0.10-0.25 s for a whole Llama load, and which run it landed in was chance (with 3
# reps it made the HF module load row read 0.79x in one run, 1.5-2.8x in nine others). Collections
# run between timed runs instead. (A gc.collect() before each run cost 0.2-0.5 s per run in pytest.)


def status_bytes(field: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; return that.

    ``ru_maxrss`` would not do: it cannot be reset, and Linux carries it across
    fork and exec, so a spawned rank starts with its parent's peak.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak RSS since :func:`reset_peak_rss` (or its start)."""
    return status_bytes("VmHWM")


def with_env(env: dict, fn, *args, **kwargs):
    """Run ``fn`` with ``env`` set, so ranks it spawns inherit it.

    The load cases spawn their ranks with glibc's mmap threshold pinned low:
    freed large buffers then go back to the OS at once, and a rank's peak RSS
    counts what each load really holds, not what an earlier one left behind.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def barrier_timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes on the slowest rank of the default process group (barriers around it)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def time_reps(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> dict:
    """Median/min/max seconds of ``fn()`` over ``reps`` runs (``setup()`` untimed before each; no garbage collection while timed)."""
    times = []
    for _ in range(max(1, reps)):
        if setup is not None:
            setup()
        with gc_paused():
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int,
                     setup: Callable[[str], object] | None = None) -> dict[str, dict]:
    """Like :func:`time_reps` for several implementations, one rep of each in turn.

    Interleaving spreads slow phases of a shared machine (a busy disk, another
    process) over every implementation instead of charging them to whichever
    ran at that moment; the order reverses every other round, so no
    implementation always runs first or right after the same neighbour.
    ``setup(name)`` runs untimed before each run, after shardkit's background
    read-ahead of the previous run (``storage.fast_io.map_prefetch``) has drained, so
    it never runs inside another implementation's timing. The garbage
    collector is off while a run is timed, so no run pays for another's garbage.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(max(1, reps)):
        for name, fn in (list(fns.items())[::-1] if rep % 2 else fns.items()):
            wait_for_prefetch()
            if setup is not None:
                setup(name)
            with gc_paused():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
            for name, ts in times.items()}


def row(case: str, impl: str, timing: dict, *, kind: str = "peer", **extra) -> dict:
    return {"case": case, "impl": impl, "kind": kind, **timing, **extra}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_table(rows: list[dict]) -> str:
    """The side-by-side table: each case's rows, then shardkit's speed ratio to each."""
    lines = []
    header = f"{'case':<34} {'impl':<40} {'median':>9} {'min':>9} {'max':>9} {'GB/s':>7} {'peak mem above baseline':>26}  shardkit speed ×"
    lines.append(header)
    lines.append("-" * len(header))
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        ours = next((r for r in group if r["impl"] == "shardkit"), None)
        for r in group:
            gbps = f"{r['bytes'] / r['median_s'] / 1e9:7.2f}" if r.get("bytes") and r["median_s"] > 0 else " " * 7
            peak = _fmt_bytes(r["peak_bytes"]) if r.get("peak_bytes") is not None else ""
            if r.get("out_bytes"):
                peak += f" (out {_fmt_bytes(r['out_bytes'])})"
            ratio = ""
            if ours is not None and r is not ours and r["median_s"] > 0:
                ratio = f"{r['median_s'] / ours['median_s']:.2f}  ({r.get('kind', 'peer')})"
            lines.append(
                f"{case:<34} {r['impl']:<40} {r['median_s']:9.4f} {r['min_s']:9.4f} {r['max_s']:9.4f} "
                f"{gbps} {peak:>26}  {ratio}"
            )
        lines.append("")
    return "\n".join(lines)


def write_json(rows: list[dict], path: str, **context) -> None:
    with open(path, "w") as f:
        json.dump({"context": context, "rows": rows}, f, indent=2)


def _files_under(dirs) -> list[str]:
    return [os.path.join(root, name) for d in dirs for root, _, files in os.walk(d) for name in files]


def evict_files(*dirs: str) -> None:
    """Drop every file under ``dirs`` from the page cache (written back first), so the next read is cold."""
    for path in _files_under(dirs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_files(*dirs: str) -> None:
    """Evict every file under ``dirs``, then read each once, sequentially (untimed): all impls start warm alike.

    An fsync'd save bypasses the page cache (shardkit writes with ``O_DIRECT``),
    another's leaves its pages cached in the folios its writes made, and how
    pages got into the cache changes what a mapped load pays on first touch
    (large folios are mapped many pages per fault). Evicting, then reading
    every file the same way, removes both differences.
    """
    evict_files(*dirs)
    for path in _files_under(dirs):
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass

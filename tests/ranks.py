"""Run a function on N real Gloo ranks, each in its own process.

Used by the multi-rank tests: ``run_ranks(fn, 4, tmp_path, extra)`` starts four
processes, initialises the default ``torch.distributed`` process group on Gloo
(rendezvous through a FileStore under ``tmp_path``), calls
``fn(rank, world_size, *args)`` in each and returns the list of return values,
ordered by rank. A failure on any rank is re-raised here with that rank's
traceback. ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, store_path, fn, args, queue):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, tmp_path, *args, timeout_s=240):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return their results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_path = str(tmp_path / f"store-{os.getpid()}-{id(fn)}-{world_size}")
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, failures = {}, []
    deadline = time.monotonic() + timeout_s
    while len(results) + len(failures) < world_size:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise AssertionError(
                    f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    if dead else f"ranks did not finish within {timeout_s} s"
                ) from None
            continue
        (results.__setitem__(rank, value) if ok else failures.append((rank, value)))
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
    if failures:
        rank, tb = failures[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world_size)]

"""Run a function on N local ranks, each a real process.

For tests, benchmarks and examples on one machine: ``run_local_ranks(fn, 4)``
starts four processes, initialises the default ``torch.distributed`` process
group in each (Gloo, rendezvous through a FileStore in a temporary directory),
calls ``fn(rank, world_size, *args)`` and returns the results ordered by rank.
With ``init_default_group=False`` no group is made and ``fn`` builds its own
(e.g. ``shardkit.comm.Group.init_rank``). A failure or death on any rank is
raised here with that rank's traceback. It is not a replacement for
``torchrun`` across machines.

Ranks are forked from a forkserver that has imported torch, DTensor
(``torch.distributed.tensor``) and ``shardkit.checkpoint`` once, so a rank
starts in milliseconds rather than re-importing them (seconds on a small
machine: DTensor alone costs about 1.5 s), and without copying the caller's
threads. The forkserver starts on the first call and serves every later one.

Example::

    def work(rank, world_size):
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return t.item()

    assert run_local_ranks(work, 3) == [3.0, 3.0, 3.0]
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["run_local_ranks"]

# What the ranks' forkserver imports once (each name by string: the forkserver imports it, this module does not)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "shardkit.checkpoint"]


def _entry(rank, world_size, store_path, fn, args, results):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if store_path is None:
            results.put((rank, True, _picklable(fn(rank, world_size, *args))))
            return
        import torch.distributed as dist

        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        try:
            results.put((rank, True, _picklable(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def _picklable(value):
    """``value``, checked here: the queue pickles in a feeder thread, which drops what it cannot pickle."""
    pickle.dumps(value)
    return value


def _context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_local_ranks(fn, world_size: int, *args, timeout_s: float = 600, workdir: str | None = None,
                    init_default_group: bool = True, may_die=()) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``fn`` and its arguments must be picklable (a module-level function).
    Ranks in ``may_die`` may exit without a result (their slot is None): for
    tests that kill a rank on purpose.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=workdir, prefix="shardkit-ranks-") as tmp:
        store_path = os.path.join(tmp, "store") if init_default_group else None
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout_s, set(may_die))
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()


def _collect(procs, results, world_size, timeout_s, may_die):
    values, failures = {}, []
    deadline = time.monotonic() + timeout_s
    gone: set[int] = set()  # exited without a result at the last poll
    while True:
        reported = set(values) | {rank for rank, _ in failures}
        # every rank reports, except one of may_die that has exited
        waiting = [r for r, p in enumerate(procs) if r not in reported and not (r in may_die and p.exitcode is not None)]
        if not waiting:
            break
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue_mod.Empty:
            # an exited rank's result is in the queue before it exits: one more quiet poll after its exit, it is dead
            dead = [r for r in waiting if r in gone and r not in may_die]
            gone = {r for r in waiting if procs[r].exitcode is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"ranks {dead} exited without a result (exit codes {[procs[r].exitcode for r in dead]})"
                    if dead
                    else f"ranks did not finish within {timeout_s} s"
                ) from None
            continue
        if ok:
            values[rank] = value
        else:
            failures.append((rank, value))
    if failures:
        rank, tb = min(failures)
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [values.get(r) for r in range(world_size)]

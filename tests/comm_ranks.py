"""Run a function on N real ranks, each its own process, WITHOUT a default process group.

``spawn_ranks(fn, 4, extra)`` creates one :class:`shardkit.comm.UniqueId`,
starts four processes and calls ``fn(rank, world_size, uid_bytes, *args)`` in
each; ``fn`` builds its own ``Group`` (usually ``Group.init_rank``). Returns
the results ordered by rank. Ranks listed in ``may_die`` are allowed to exit
without a result (their slot is ``None``): used to kill a rank on purpose.
``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback

import torch.multiprocessing as mp

from shardkit.comm import UniqueId


def _entry(rank, world_size, uid_bytes, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        queue.put((rank, True, fn(rank, world_size, uid_bytes, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def _context():
    # A forkserver that has imported torch once forks each rank in milliseconds;
    # "spawn" would import torch again per rank (seconds each on a small machine),
    # and "fork" would copy this process's threads (Gloo's, from other tests).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardkit.comm", "comm_ranks"])
    return ctx


def spawn_ranks(fn, world_size, *args, timeout_s=120, may_die=()):
    """Run ``fn(rank, world_size, uid_bytes, *args)`` on ``world_size`` processes; return results."""
    ctx = _context()
    queue = ctx.Queue()
    uid = UniqueId.new(host="127.0.0.1").as_bytes()
    procs = [ctx.Process(target=_entry, args=(r, world_size, uid, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, []
    deadline = time.monotonic() + timeout_s
    expected = world_size - len(may_die)
    while len(results) + len(failures) < expected:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in may_die and not p.is_alive() and r not in results]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise AssertionError(
                    f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                    if dead else f"ranks did not finish within {timeout_s} s") from None
            continue
        (results.__setitem__(rank, value) if ok else failures.append((rank, value)))
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if failures:
        rank, tb = failures[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results.get(r) for r in range(world_size)]

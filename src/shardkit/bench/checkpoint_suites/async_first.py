"""The first background save of a process, timed in a fresh process per run.

A first ``save_async`` (or ``dcp.async_save``) pays for the staging memory it
allocates; whether that memory is fresh (faulted in on first touch, slow on
a VM that backs its memory lazily) or recycled from the process's own heap
depends on what the process freed before. Timing each implementation's
first call in its own new process, after the same preparation, gives both
the same start. :func:`first_call_blocked` runs one such child;
``python -m shardkit.bench.checkpoint_suites.async_first IMPL SIZE_BYTES DIR SETTLE_S [BALLAST_BYTES]`` is the child.

The child builds the benchmark state (``workload.make_state``), makes its
checkpointer (shardkit; the ``PREPARED`` row also calls
``prepare(state, background=True)`` then, which returns at once), waits ``SETTLE_S`` seconds (the kernel takes back memory freed while
building the state, as in a job that has run for a while), then times the
one call, waits for the save to finish (untimed) and prints the seconds the
call blocked as JSON. Not timed: the state, the imports, the write.

``ballast_bytes`` (default 0) makes the child fill that many bytes of its
own (untimed, kept alive) before it settles: memory the process's
neighbours freed recently is used up first, so the timed call's staging
lands on memory the kernel has long had free, on a VM with free page
reporting memory the host has taken back (the slowest to fault in). On the
2-core benchmark VM a 6 GiB ballast turned 0.33-0.56 s first calls into
2.4-3.3 s ones, for every implementation measured (three children each:
shardkit's median 2.75 s, ``dcp.async_save``'s 2.96 s).

Example::

    blocked_s = first_call_blocked("shardkit", 256 << 20, "/tmp/bench/async-first")
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from shardkit import knobs
from shardkit.bench.peers import single_process_dcp
from shardkit.bench.workload import make_state
from shardkit.checkpoint import AsyncCheckpointer, ShardMetadata

__all__ = ["IMPLS", "DCP_ASYNC", "PREPARED", "SETTLE_S", "first_call_blocked"]

#: Seconds the child waits after building its state, before the timed call.
SETTLE_S: float = 2.5

#: The peer's name among ``IMPLS``.
DCP_ASYNC = "torch.distributed.checkpoint.async_save"

#: The row whose checkpointer was given the state at start-up, to allocate its buffers in the background.
PREPARED = "shardkit, prepare(background=True)"

#: impl name -> what the child calls.
IMPLS = {
    "shardkit": "AsyncCheckpointer(dir, 0, 1, ...).save_async(state)",
    "shardkit, knobs.STAGING_PREFAULT=False": "the same, the copies faulting the fresh buffers themselves",
    PREPARED: "the same, after prepare(state, background=True) at construction (before the settle)",
    DCP_ASYNC: "dcp.async_save(state, storage_writer=FileSystemWriter(dir, sync_files=True))",
}


def first_call_blocked(impl: str, size_bytes: int, dir: str, *, settle_s: float = SETTLE_S,
                       ballast_bytes: int = 0, timeout_s: float = 600) -> float:
    """Seconds the first ``impl`` call blocked its caller, measured in a new Python process.

    ``settle_s``: the child's wait between building its state and the call;
    ``ballast_bytes``: memory the child fills and holds before it (see above).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown async impl {impl!r}; known: {sorted(IMPLS)}")
    argv = [impl, str(size_bytes), dir, str(settle_s), str(ballast_bytes)]
    done = subprocess.run([sys.executable, "-m", "shardkit.bench.checkpoint_suites.async_first", *argv],
                          capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"the first-call child for {impl} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["blocked_s"])


def _shardkit_first(state, dir: str, settle_s: float, *, prefault: bool = True, prepare: bool = False) -> float:
    knobs.STAGING_PREFAULT = prefault
    ckpt = AsyncCheckpointer(dir, 0, 1, ShardMetadata(num_ranks=1, tensor_specs={}))
    if prepare:
        ckpt.prepare(state, background=True)  # returns at once; not timed, as the constructor is not
    time.sleep(settle_s)
    start = time.perf_counter()
    future = ckpt.save_async(state)
    blocked = time.perf_counter() - start
    future.wait()
    ckpt.close()
    return blocked


def _dcp_first(state, dir: str, settle_s: float) -> float:
    time.sleep(settle_s)
    with single_process_dcp():
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(dir, sync_files=True))
        blocked = time.perf_counter() - start
        future.result()
    return blocked


def _child(argv: list[str]) -> None:
    impl, size_bytes, dir, settle_s = argv[0], int(argv[1]), argv[2], float(argv[3])
    state = make_state(size_bytes)
    ballast = torch.ones(int(argv[4]) // 4 if len(argv) > 4 else 0)  # noqa: F841 - held until the child exits
    run = {"shardkit": _shardkit_first,
           "shardkit, knobs.STAGING_PREFAULT=False": lambda *a: _shardkit_first(*a, prefault=False),
           PREPARED: lambda *a: _shardkit_first(*a, prepare=True),
           DCP_ASYNC: _dcp_first}[impl]
    print(json.dumps({"impl": impl, "blocked_s": run(state, dir, settle_s)}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1:])

"""One process-wide pool of I/O threads, shared by every parallel read.

Loads call :func:`run_parallel` with a list of independent jobs (range
reads, copies); the jobs run on ``knobs.IO_THREADS`` threads that live as
long as the process, so a load of many small files does not pay for
starting and joining a new pool each time. It does not split work into jobs
(the callers do) and it is not used for writes (``writer.py`` keeps its own
per-file threads, since a write's threads also start the file's writeback).

Safe to call from several threads at once, and from inside a job (a nested
call runs its jobs inline rather than wait on its own pool); a forked child
starts a fresh pool.

Example::

    run_parallel([lambda o=o: reader.read_into(o, views[o]) for o in offsets])
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence

from shardkit import knobs

__all__ = ["run_parallel"]

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_in_worker = threading.local()


def run_parallel(jobs: Sequence[Callable[[], None]]) -> None:
    """Run ``jobs`` on the shared I/O threads and wait for all; re-raise the first failure.

    With one job, one thread configured (``knobs.IO_THREADS <= 1``) or when
    called from one of the pool's own threads, runs them inline, in order.
    Every job is waited for even if one fails, so no job is still writing
    into a caller's buffer after this returns.
    """
    threads = min(max(1, knobs.IO_THREADS), len(jobs))
    if threads <= 1 or getattr(_in_worker, "active", False):
        for job in jobs:
            job()
        return
    futures = [_executor().submit(_as_worker, job) for job in jobs]
    first_error: BaseException | None = None
    for future in futures:
        error = future.exception()
        if error is not None and first_error is None:
            first_error = error
    if first_error is not None:
        raise first_error


def _as_worker(job: Callable[[], None]) -> None:
    _in_worker.active = True
    try:
        job()
    finally:
        _in_worker.active = False


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_threads
    wanted = max(1, knobs.IO_THREADS)
    with _lock:
        if _pool is None or _pool_threads != wanted:
            old, _pool = _pool, ThreadPoolExecutor(wanted, thread_name_prefix="shardkit-io")
            _pool_threads = wanted
            if old is not None:
                old.shutdown(wait=False)  # its queued jobs still run; new ones go to the new pool
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads.
    global _pool, _pool_threads, _lock
    _pool, _pool_threads, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)

"""A clean interpreter exit for jobs with background saves: finish the saves, then free their groups.

A job that forgets ``close()`` / ``wait()`` and ends its main thread must
still exit 0 with every checkpoint intact. Background save threads are not
daemons, so Python waits for them before it runs ``atexit`` hooks; what
remained was the Gloo groups made for those threads: left alive, they were
torn down by the interpreter's own finalisation, in an order torch does not
support, and about one run in three under ``torchrun`` died with
``terminate called without an active exception`` (SIGABRT) after every
save had finished (a plain torch job that leaves a ``new_group`` alive does
the same); and a save still running when the main thread ended failed,
since Python shuts ``concurrent.futures`` down first. The hooks registered
here run before either: one (a ``threading`` exit hook, run before the
thread pools close) joins any background save still running; the other
(``atexit``) then calls ``torch.distributed.destroy_process_group()``
(every group, the default one included, as torch asks a job to do before it
exits) while the interpreter is still whole. It is registered only once
shardkit made a group or started a background save; an ``atexit`` hook the
job registered *earlier* runs after it and finds no process group.

Example::

    group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    destroy_at_exit(group)
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

import torch.distributed as dist

__all__ = ["destroy_at_exit", "join_at_exit"]

_lock = threading.Lock()
_groups: list = []
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_futures: "weakref.WeakSet" = weakref.WeakSet()  # their CheckpointFutures: failures nobody waited for
_registered = False
log = logging.getLogger("shardkit.checkpoint")


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        # Python marks concurrent.futures shut down when the main thread ends, *before* it joins
        # the other non-daemon threads, so a save still running then failed on its first thread
        # pool ("cannot schedule new futures after interpreter shutdown"). threading's own exit
        # hooks run newest first, so this one (registered after concurrent.futures imported)
        # finishes the saves while their pools still work.
        try:
            threading._register_atexit(_join_saves)
        except RuntimeError:
            pass  # already shutting down (a save started from an exit hook): atexit still joins it
        _registered = True


def _join_saves() -> None:
    for future in list(_futures):
        future.hurry()  # nobody trains any more: the rest at full speed
    for thread in list(_threads):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join()
    _report_unseen_failures()


def _report_unseen_failures() -> None:
    """Log each background save that failed and that no ``wait()``/``close()`` ever raised: a job that
    forgot ``close()`` must not lose its last checkpoint in silence."""
    for future in list(_futures):
        if future.done() and future.error is not None and not future.reported:
            future.mark_reported()
            error = future.error
            log.error("the %s to %s failed, and nothing waited for it: %s: %s. That checkpoint is incomplete "
                      "and will not load; wait() on the future (or close() the checkpointer) to raise such "
                      "failures where they happen", future.description, future.dir, type(error).__name__, error)


def destroy_at_exit(group) -> None:
    """Destroy the torch process group ``group`` (made by shardkit) when the interpreter exits."""
    with _lock:
        _register()
        _groups.append(group)


def join_at_exit(thread: threading.Thread, future=None) -> None:
    """Join ``thread`` (a background save) at exit, before the groups it uses are destroyed; then log
    the failure of its ``future`` (a ``CheckpointFuture``) if it failed and nothing raised it."""
    with _lock:
        _register()
        _threads.add(thread)
        if future is not None:
            _futures.add(future)


def _at_exit() -> None:
    _join_saves()
    with _lock:
        groups, _groups[:] = list(_groups), []
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return
        # Measured under torchrun (2 Gloo ranks, 8-12 runs each): a job that leaves a group from
        # new_group alive at exit aborts in 1 run of 8 to 1 of 2 even without shardkit, and destroying
        # only that group still aborted 1 run of 8; destroying every group (the default one last,
        # as destroy_process_group() does) never did. So, once shardkit made a group or ran a
        # background save in this process, the exit destroys them all, the way torch asks jobs to.
        del groups
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - never turn a clean exit into a failure
        pass

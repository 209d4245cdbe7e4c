"""Abort handles and the bounded wait every collective goes through.

Every collective is issued asynchronously and then waited for here, against
three things: its completion, the group's abort flag, and a deadline (the
group's timeout plus ``knobs.COMM_TIMEOUT_SLACK_S``). So a dead peer or a
watchdog's ``abort()`` turns into a typed error instead of a hang. This module
does not kill the backend's own blocked thread (Gloo has no way to interrupt
it); it frees the caller and marks the group unusable.

Example::

    handle = group.abort_handle()
    threading.Timer(30, handle.abort).start()   # a watchdog
    group.all_reduce_([t])                      # CommAbortedError if it takes longer
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from shardkit import knobs
from shardkit.errors import CommAbortedError, CommError, CommTimeoutError

__all__ = ["AbortHandle", "wait_work"]


class AbortHandle:
    """Aborts one group from any thread: ``abort()`` is idempotent, ``is_aborted`` reads the flag.

    It does not close sockets of other ranks; they find out through their own
    timeout or their own handle.

    Example::

        h = group.abort_handle()
        h.abort(); h.abort()      # the second call does nothing
        assert h.is_aborted
    """

    def __init__(self, on_abort=None):
        self._lock = threading.Lock()
        self._aborted = False
        self._waiters: set[threading.Event] = set()
        self._on_abort = on_abort  # e.g. the process group's own abort()

    @property
    def is_aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Make blocked and future collectives of this group raise ``CommAbortedError``."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            waiters = list(self._waiters)
        for ev in waiters:
            ev.set()  # wake blocked waiters now rather than at their next poll
        if self._on_abort is not None:
            try:
                self._on_abort()
            except Exception:  # noqa: BLE001 - the backend may already be gone
                pass

    def _add(self, ev: threading.Event) -> None:
        with self._lock:
            self._waiters.add(ev)
            if self._aborted:
                ev.set()

    def _remove(self, ev: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(ev)


class _Completion:
    """Tells when one backend work has finished, and how: set by a callback or a helper thread."""

    def __init__(self, work):
        self.event, self.done, self.error, self._work = threading.Event(), False, None, work
        try:
            fut = work.get_future()
        except RuntimeError:
            # Gloo's send/recv and reduce_scatter works have no future and never
            # report is_completed(); only wait() tells, so a helper thread waits.
            self.threaded = True
            threading.Thread(target=self._wait_in_thread, daemon=True).start()
            return
        self.threaded = False
        fut.add_done_callback(self._on_done)

    def _on_done(self, _fut) -> None:
        self.done = True
        self.event.set()

    def _wait_in_thread(self) -> None:
        try:
            self._work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = e
        finally:
            self.done = True
            self.event.set()

    def result(self) -> None:
        """Raise the work's error, if it failed (call once ``done``)."""
        if self.error is not None:
            raise self.error
        if not self.threaded:
            self._work.wait()  # already complete: returns at once or raises the backend's error


def wait_work(work, *, what: str, timeout: timedelta, handle: AbortHandle, backend_wait: bool = False,
              has_future: bool | None = None, gpu_host_wait: bool = False) -> None:
    """Block until ``work`` completes; raise a ``CommError`` on abort, timeout or failure.

    ``backend_wait`` (Gloo) waits inside the backend in slices that double
    from ``knobs.COMM_ABORT_POLL_S`` to ``knobs.COMM_ABORT_POLL_MAX_S`` (the
    abort flag and the deadline are checked between them): the fastest
    wake-up, since a Python callback would need extra thread switches.
    ``has_future``: whether the work has a future (None: ask it, which costs
    a call into the backend; callers that know, e.g. all_reduce, say so).
    ``gpu_host_wait`` (an NCCL group with ``knobs.COMM_NCCL_BLOCKING_WAIT``):
    an NCCL work's future completes once the work is queued, so the wait then
    polls ``work.is_completed()`` (a CUDA event query) until the GPU has
    finished it, under the same deadline and abort flag. Without it a CUDA
    collective is waited for as torch waits: the current stream is ordered
    after it, the host is not.
    """
    deadline = time.monotonic() + timeout.total_seconds() + knobs.COMM_TIMEOUT_SLACK_S
    if backend_wait and (has_future if has_future is not None else _has_future(work)):
        _wait_in_backend(work, what, deadline, handle, timeout)
        return
    c = _Completion(work)
    handle._add(c.event)
    try:
        while not c.event.wait(min(knobs.COMM_ABORT_POLL_S, max(0.0, deadline - time.monotonic()))):
            _check(what, deadline, handle, timeout)
        if not c.done:
            _check(what, deadline, handle, timeout)  # woken by abort(): raises CommAbortedError
        if gpu_host_wait and not c.threaded:
            _wait_for_gpu(work, what, deadline, handle, timeout)
    finally:
        handle._remove(c.event)
    try:
        c.result()
    except Exception as e:  # noqa: BLE001 - backends raise RuntimeError or DistBackendError
        raise translate_failure(e, what, timeout) from e


def _has_future(work) -> bool:
    # Works without a future (Gloo send/recv, reduce_scatter) never report
    # is_completed(), so only the helper-thread path can tell when they finish.
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def _wait_in_backend(work, what, deadline, handle, timeout) -> None:
    # Slices double from COMM_ABORT_POLL_S to COMM_ABORT_POLL_MAX_S: a short wait re-checks the
    # abort flag often, a long one costs few timed-out slices (see knobs).
    slice_s = knobs.COMM_ABORT_POLL_S
    cap_s = max(slice_s, knobs.COMM_ABORT_POLL_MAX_S)
    while True:
        _check(what, deadline, handle, timeout)
        try:
            work.wait(timedelta(seconds=slice_s))
            return
        except Exception as e:  # noqa: BLE001 - see below
            if not _slice_ran_out(e):
                raise translate_failure(e, what, timeout) from e
            # Only the slice ran out. The work may have finished just since:
            # that is no failure, and an untimed wait now returns at once or
            # raises the work's own error.
            if work.is_completed():
                _finish_completed(work, what, timeout)
                return
        slice_s = min(2 * slice_s, cap_s)


def _wait_for_gpu(work, what, deadline, handle, timeout) -> None:
    # Pauses grow from a bare yield to _GPU_POLL_MAX_S: a short collective costs
    # a few event queries, a long one at most that much latency past its end.
    pause_s = 0.0
    while not work.is_completed():
        _check(what, deadline, handle, timeout)
        time.sleep(pause_s)
        pause_s = min(max(2 * pause_s, 1e-5), _GPU_POLL_MAX_S)


#: The longest pause between two queries of a CUDA collective's completion.
_GPU_POLL_MAX_S = 1e-3


def _finish_completed(work, what, timeout) -> None:
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - backends raise RuntimeError or DistBackendError
        raise translate_failure(e, what, timeout) from e


def _slice_ran_out(e: BaseException) -> bool:
    # c10d's Work.wait(timeout) raises exactly this when the work was still
    # pending as the timeout expired; a finished work returns or raises its own error.
    return "Operation timed out!" in str(e)


def _check(what, deadline, handle, timeout) -> None:
    if handle.is_aborted:
        raise CommAbortedError(
            f"{what} was interrupted: the group was aborted (AbortHandle.abort()). "
            "Its result is undefined; create a new group to continue."
        )
    if time.monotonic() > deadline:
        raise CommTimeoutError(
            f"{what} did not finish within the group's timeout of {timeout.total_seconds():g} s "
            f"(+{knobs.COMM_TIMEOUT_SLACK_S:g} s grace); a peer rank is probably dead or stuck. "
            "Raise the timeout in Group.init_rank(..., timeout=) if the work is just slow."
        )


def translate_failure(e: BaseException, what: str, timeout: timedelta) -> CommError:
    """Map a backend exception to the shardkit error tree, keeping its text."""
    text = str(e)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CommTimeoutError(
            f"{what} timed out after the group's timeout of {timeout.total_seconds():g} s; "
            f"a peer rank is probably dead or stuck. Backend said: {text.strip()[:300]}"
        )
    return CommError(
        f"{what} failed in the backend; a peer rank may have died or the ranks called "
        f"different collectives. Backend said: {text.strip()[:300]}"
    )

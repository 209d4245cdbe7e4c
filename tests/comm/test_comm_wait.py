"""wait_work against fake backend works: the races of a sliced wait, without any process group."""

from datetime import timedelta

import pytest

from shardkit import knobs
from shardkit.comm.abort import AbortHandle, wait_work
from shardkit.errors import CommAbortedError, CommError, CommTimeoutError


class SlicedWork:
    """A work whose ``wait(timeout)`` runs out ``slices`` times, then finishes (or fails).

    ``finish_during_last_slice`` models the race that used to fail the
    caller: the slice's wait gives up, and the work completes right after,
    before the waiter looks at ``is_completed()``.
    """

    def __init__(self, slices: int, *, error: str | None = None, finish_during_last_slice: bool = False):
        self.slices, self.error, self.race = slices, error, finish_during_last_slice
        self.completed = False
        self.waits = 0
        self.timeouts_s: list[float | None] = []

    def get_future(self):
        return object()

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout=None):
        self.waits += 1
        self.timeouts_s.append(None if timeout is None else timeout.total_seconds())
        if self.completed:
            if self.error:
                raise RuntimeError(self.error)
            return True
        if self.slices > 0 and timeout is not None:
            self.slices -= 1
            if self.slices == 0 and self.race:
                self.completed = True  # finishes just as the slice gives up
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if self.error:
            raise RuntimeError(self.error)
        return True


def _wait(work, timeout_s=30.0, handle=None):
    wait_work(work, what="all_reduce_", timeout=timedelta(seconds=timeout_s),
              handle=handle or AbortHandle(), backend_wait=True)


def test_work_finishing_as_a_slice_runs_out_is_not_a_failure():
    work = SlicedWork(3, finish_during_last_slice=True)
    _wait(work)  # used to raise CommTimeoutError("... Operation timed out!")
    assert work.completed


def test_slow_work_is_waited_for_over_many_slices():
    work = SlicedWork(7)
    _wait(work)
    assert work.waits == 8


def test_slices_double_up_to_the_cap(monkeypatch):
    # Each slice that runs out costs the waiting process CPU: a long wait takes few, a short one checks often.
    monkeypatch.setattr(knobs, "COMM_ABORT_POLL_S", 0.05)
    monkeypatch.setattr(knobs, "COMM_ABORT_POLL_MAX_S", 0.4)
    work = SlicedWork(6)
    _wait(work)
    assert work.timeouts_s == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4])


def test_a_cap_below_the_first_slice_keeps_the_first(monkeypatch):
    monkeypatch.setattr(knobs, "COMM_ABORT_POLL_S", 0.05)
    monkeypatch.setattr(knobs, "COMM_ABORT_POLL_MAX_S", 0.0)
    work = SlicedWork(2)
    _wait(work)
    assert work.timeouts_s == pytest.approx([0.05, 0.05, 0.05])


def test_work_error_after_the_race_is_the_works_own():
    work = SlicedWork(2, error="Connection closed by peer", finish_during_last_slice=True)
    with pytest.raises(CommError, match="Connection closed by peer") as info:
        _wait(work)
    assert not isinstance(info.value, CommTimeoutError)


def test_a_work_that_never_finishes_times_out(monkeypatch):
    monkeypatch.setattr(knobs, "COMM_TIMEOUT_SLACK_S", 0.0)
    monkeypatch.setattr(knobs, "COMM_ABORT_POLL_S", 0.01)

    class Stuck(SlicedWork):
        def wait(self, timeout=None):
            import time

            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")

    with pytest.raises(CommTimeoutError, match="did not finish within"):
        _wait(Stuck(0), timeout_s=0.05)


def test_abort_between_slices_raises_aborted():
    handle = AbortHandle()

    class AbortsMidway(SlicedWork):
        def wait(self, timeout=None):
            handle.abort()
            raise RuntimeError("Operation timed out!")

    with pytest.raises(CommAbortedError):
        _wait(AbortsMidway(5), handle=handle)

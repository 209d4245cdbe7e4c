"""wait_work's host wait for CUDA collectives (knobs.COMM_NCCL_BLOCKING_WAIT), against fake works.

An NCCL work's future completes once the work is queued; ``is_completed()``
turns true only when the GPU has finished it. These fakes do the same, so the
deadline and abort logic runs without a GPU (tests/gpu/test_nccl_wait.py runs
it for real).
"""

import threading
import time
from datetime import timedelta

import pytest

from shardkit.comm.abort import AbortHandle, wait_work
from shardkit.errors import CommAbortedError, CommError, CommTimeoutError


class _DoneFuture:
    def add_done_callback(self, fn):
        fn(self)


class QueuedWork:
    """A CUDA-like work: queued at once, finished on the GPU after ``gpu_s`` (never, if None)."""

    def __init__(self, gpu_s: float | None, error: str | None = None):
        self._done_at = None if gpu_s is None else time.monotonic() + gpu_s
        self.error, self.queries = error, 0

    def get_future(self):
        return _DoneFuture()

    def is_completed(self) -> bool:
        self.queries += 1
        return self._done_at is not None and time.monotonic() >= self._done_at

    def wait(self, timeout=None):
        if self.error:
            raise RuntimeError(self.error)
        return True


def _wait(work, *, host: bool, timeout_s=30.0, handle=None):
    wait_work(work, what="all_reduce_", timeout=timedelta(seconds=timeout_s),
              handle=handle or AbortHandle(), gpu_host_wait=host)


def test_without_host_wait_a_queued_work_returns_at_once():
    work = QueuedWork(gpu_s=None)
    t0 = time.monotonic()
    _wait(work, host=False)
    assert time.monotonic() - t0 < 0.5 and work.queries == 0


def test_host_wait_returns_once_the_gpu_has_finished():
    work = QueuedWork(gpu_s=0.3)
    t0 = time.monotonic()
    _wait(work, host=True)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert work.queries > 1


def test_host_wait_raises_a_timeout_at_the_deadline(monkeypatch):
    monkeypatch.setattr("shardkit.knobs.COMM_TIMEOUT_SLACK_S", 0.0)
    with pytest.raises(CommTimeoutError, match="timeout of 0.3 s"):
        _wait(QueuedWork(gpu_s=None), host=True, timeout_s=0.3)


def test_host_wait_is_interrupted_by_abort():
    handle = AbortHandle()
    threading.Timer(0.2, handle.abort).start()
    t0 = time.monotonic()
    with pytest.raises(CommAbortedError):
        _wait(QueuedWork(gpu_s=None), host=True, handle=handle)
    assert time.monotonic() - t0 < 2.0


def test_a_failed_work_raises_its_backend_error_as_comm_error():
    with pytest.raises(CommError, match="NCCL error"):
        _wait(QueuedWork(gpu_s=0.0, error="NCCL error: remote process exited"), host=True)

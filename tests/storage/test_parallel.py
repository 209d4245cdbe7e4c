"""The shared I/O pool: every job runs, failures surface after all jobs finished, nesting runs inline."""

import os
import threading

import pytest

from shardkit import knobs
from shardkit.storage import run_parallel


def test_runs_every_job_on_pool_threads(monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 3)
    seen, lock = [], threading.Lock()

    def job(i):
        with lock:
            seen.append((i, threading.current_thread().name))

    run_parallel([lambda i=i: job(i) for i in range(50)])
    assert sorted(i for i, _ in seen) == list(range(50))
    assert all(name.startswith("shardkit-io") for _, name in seen)


def test_first_error_is_raised_after_all_jobs_ran(monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 2)
    done = []

    def bad():
        raise OSError("disk gone")

    jobs = [bad] + [lambda i=i: done.append(i) for i in range(20)]
    with pytest.raises(OSError, match="disk gone"):
        run_parallel(jobs)
    assert sorted(done) == list(range(20))


def test_nested_call_runs_inline_instead_of_deadlocking(monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 2)
    out = []
    run_parallel([lambda: run_parallel([lambda: out.append(1)] * 5) for _ in range(4)])
    assert out == [1] * 20


def test_one_thread_or_one_job_runs_inline(monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 1)
    names = []
    run_parallel([lambda: names.append(threading.current_thread().name)] * 3)
    assert names == [threading.current_thread().name] * 3
    run_parallel([])  # no jobs: nothing to do


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_working_pool(monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 2)
    run_parallel([lambda: None] * 4)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:
        try:
            out = []
            run_parallel([lambda: out.append(1)] * 8)
            os._exit(0 if out == [1] * 8 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

"""How an NCCL group's CUDA collectives wait: stream-ordered (torch's way) or on the host.

Each case runs in a fresh process: a timed-out or aborted communicator must not
leave the test process's CUDA context behind it. The GPU is kept busy with
``torch.cuda._sleep`` queued ahead of the collective, so a one-GPU machine can
hold a collective back for as long as a dead peer would. Skipped without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="torch built without NCCL")]

_CASE = textwrap.dedent("""
    import json, os, sys, threading, time
    from datetime import timedelta
    import torch
    from shardkit import knobs
    from shardkit.comm import Group
    from shardkit.errors import CommError

    host_wait, busy_s, abort_after_s = sys.argv[1] == "host", float(sys.argv[2]), float(sys.argv[3])
    knobs.COMM_NCCL_BLOCKING_WAIT = host_wait
    (g,) = Group.local(1, backend="nccl", timeout=timedelta(seconds=1))
    t = torch.ones(4, device="cuda")
    g.all_reduce_([t])
    torch.cuda.synchronize()  # the communicator is built
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    cycles_per_s = 10**8 / (time.perf_counter() - t0)
    torch.cuda._sleep(int(cycles_per_s * busy_s))  # the collective queues behind this
    if abort_after_s > 0:
        threading.Timer(abort_after_s, g.abort_handle().abort).start()
    out = {}
    t0 = time.perf_counter()
    try:
        g.all_reduce_([t])
        out["raised"] = None
    except CommError as e:
        out["raised"], out["message"] = type(e).__name__, str(e)
    out["returned_s"] = time.perf_counter() - t0
    try:
        g.all_reduce_([t])
        out["then"] = None
    except CommError as e:
        out["then"] = type(e).__name__
    torch.cuda.synchronize()
    out["value"] = t.tolist()
    out["gpu_usable"] = (torch.ones(3, device="cuda") * 2).sum().item() == 6.0
    print(json.dumps(out), flush=True)
    os._exit(0)  # an aborted communicator's teardown is not under test
""")


def _run(mode: str, busy_s: float, abort_after_s: float = 0.0) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CASE, mode, str(busy_s), str(abort_after_s)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_by_default_a_cuda_collective_returns_once_queued_and_the_stream_sees_its_result():
    out = _run("stream", busy_s=2.0)
    assert out["raised"] is None and out["then"] is None
    assert out["returned_s"] < 1.0  # the GPU was still busy for ~2 s
    assert out["value"] == [1.0] * 4 and out["gpu_usable"]


def test_host_wait_returns_when_the_gpu_has_finished_the_collective():
    out = _run("host", busy_s=2.0)  # inside the 1 s timeout + 2 s grace
    assert out["raised"] is None and out["then"] is None
    assert out["returned_s"] > 1.5
    assert out["value"] == [1.0] * 4 and out["gpu_usable"]


def test_host_wait_raises_at_the_deadline_and_leaves_the_gpu_usable():
    out = _run("host", busy_s=8.0)
    assert out["raised"] == "CommTimeoutError", out
    assert "timeout of 1 s" in out["message"]
    assert 2.5 < out["returned_s"] < 6.0  # 1 s timeout + 2 s grace, not the 8 s of GPU work
    assert out["then"] == "CommError"     # the group is unusable afterwards
    assert out["gpu_usable"]


def test_host_wait_is_interrupted_by_abort_from_another_thread():
    out = _run("host", busy_s=8.0, abort_after_s=0.5)
    assert out["raised"] == "CommAbortedError", out
    assert out["returned_s"] < 2.0
    assert out["then"] == "CommAbortedError"
    assert out["gpu_usable"]

"""Multi-node on loopback (issue 13): two ``torchrun`` launchers save, a one-node job resumes.

The test starts two launchers on this machine, ``torchrun --nnodes 2
--nproc-per-node 1 --node-rank {0,1} --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT`` (node 0 hosts the rendezvous store; everything binds loopback),
whose workers save a DTensor-sharded state with ``shardkit.checkpoint.save``
(``group=None``: the default process group torchrun's variables set up) into
a directory standing in for a shared filesystem (``tests/s3/test_s3_multinode.py``: into S3). A second job, ``--nnodes 1``,
loads it with plain tensors (another world size) and checks every value.
This file is also the workers' script (``python test_multinode.py save|load DIR``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

_ROWS, _COLS = 8, 3
_JOB_TIMEOUT_S = 180.0


def _full_state():
    import torch

    return {"model": {"w": torch.arange(_ROWS * _COLS, dtype=torch.float32).reshape(_ROWS, _COLS),
                      "b": torch.linspace(0, 1, 5)},
            "step": 7}


def _worker(mode: str, directory: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import shardkit.checkpoint as ckpt

    dist.init_process_group("gloo")          # torchrun's MASTER_ADDR, RANK, WORLD_SIZE...
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full_state()
    try:
        if mode == "save":
            mesh = init_device_mesh("cpu", (world,))
            rows = _ROWS // world
            w = DTensor.from_local(full["model"]["w"][rank * rows:(rank + 1) * rows], mesh, [Shard(0)])
            ckpt.save({"model": {"w": w, "b": full["model"]["b"]}, "step": full["step"]}, directory)
        else:
            state = {"model": {"w": torch.zeros(_ROWS, _COLS), "b": torch.zeros(5)}, "step": 0}
            ckpt.load(state, directory)
            assert torch.equal(state["model"]["w"], full["model"]["w"]), state["model"]["w"]
            assert torch.equal(state["model"]["b"], full["model"]["b"]), state["model"]["b"]
            assert state["step"] == full["step"], state["step"]
        print(f"rank {rank} of {world}: {mode} ok", flush=True)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.access(beside, os.X_OK):
        return [beside]
    return [sys.executable, "-m", "torch.distributed.run"]


def _launcher(nnodes: int, node_rank: int, port: int, mode: str, directory: str) -> subprocess.Popen:
    args = [*_torchrun(), "--nnodes", str(nnodes), "--nproc-per-node", "1", "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"shardkit-{port}",
            "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", "--monitor-interval", "0.5",
            os.path.abspath(__file__), mode, directory]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run_job(nnodes: int, mode: str, directory: str) -> list[str]:
    """Start ``nnodes`` launchers (one worker each); wait for all; kill all on failure or timeout."""
    port = _free_port()
    procs = []
    try:
        for node in range(nnodes):
            procs.append(_launcher(nnodes, node, port, mode, directory))
        deadline = time.monotonic() + _JOB_TIMEOUT_S
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace")
                   for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    codes = [p.returncode for p in procs]
    assert codes == [0] * nnodes, f"{mode} job exit codes {codes}:\n" + "\n----\n".join(o[-3000:] for o in outputs)
    return outputs


def test_two_node_save_resumes_on_one_node(tmp_path):
    two_node_save_then_one_node_load(str(tmp_path / "shared" / "step-7"))   # stands in for a shared filesystem


def two_node_save_then_one_node_load(directory: str) -> None:
    """The scenario, on ``directory`` (a path or URL); tests/s3/test_s3_multinode.py runs it on S3."""
    saved = _run_job(2, "save", directory)
    assert "rank 0 of 2: save ok" in saved[0] and "rank 1 of 2: save ok" in saved[1], saved
    from shardkit.checkpoint import validate_distributed

    report = validate_distributed(directory)
    assert report.ok, report
    loaded = _run_job(1, "load", directory)
    assert "rank 0 of 1: load ok" in loaded[0], loaded


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])

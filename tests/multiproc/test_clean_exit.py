"""A job with background saves that forgets close() exits 0 with its checkpoints intact (issue 11, part 5).

Each run starts two real ranks as their own interpreters (torchrun's
variables), so the interpreter's exit is the one under test. Left to the
interpreter's teardown, a Gloo group from ``new_group`` aborted such jobs
with ``terminate called without an active exception`` in about a third of
runs; ``shardkit.checkpoint.background.shutdown`` tears the groups down first.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardkit.checkpoint import CheckpointManager, validate_distributed

pytestmark = pytest.mark.multiproc

CHILD = os.path.join(os.path.dirname(__file__), "exit_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("run", range(3))
def test_background_saves_without_close_exit_cleanly(tmp_path, run):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, CHILD, str(tmp_path)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outputs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for name in ("old", "api", "last", "mgr/step-1", "mgr/step-2"):
        assert validate_distributed(tmp_path / name).ok, name
    assert CheckpointManager(tmp_path / "mgr").steps() == [1, 2]

"""Shared pieces of the CLI tests: run ``shardkit`` in a subprocess or in this process, make small
checkpoints, DCP rank saves."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys

import torch

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed


def shardkit(*argv, timeout=120, env=None):
    """``python -m shardkit.cli ARGV`` in a subprocess: (exit code, stdout, stderr)."""
    out = subprocess.run([sys.executable, "-m", "shardkit.cli", *map(str, argv)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    return out.returncode, out.stdout, out.stderr


def in_process(*argv):
    """The same call through ``shardkit.cli.main`` in this process: (exit code, stdout, stderr).

    No interpreter start or torch import (a subprocess costs seconds on a busy 2-core box); the
    end-to-end subprocess runs are kept for one happy path and one bad input per subcommand.
    Loggers that ``-v`` configures are put back afterwards.
    """
    from shardkit.cli import main

    logger = logging.getLogger("shardkit")
    handlers, level = list(logger.handlers), logger.level
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as e:  # argparse usage errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, out, err, expected_code=2):
    assert code == expected_code, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def training_state(seed=0, rows=8):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(rows, 4, generator=g), "b": torch.randn(4, generator=g),
                      "ids": torch.arange(6)},
            "optim": {"w_m": torch.randn(rows, 4, generator=g)}, "step": 3}


def save_sharded(state, path, world_size=2):
    """Save ``state`` as ``world_size`` ranks would, ``model.w`` and ``optim.w_m`` split on dim 0."""
    rows = state["model"]["w"].shape[0]
    sizes = [rows // world_size + (1 if r < rows % world_size else 0) for r in range(world_size)]
    spec = ShardMetadata(world_size, {n: TensorShardSpec((rows, 4), 0, tuple(sizes)) for n in ("model.w", "optim.w_m")})
    for rank in reversed(range(world_size)):
        start = sum(sizes[:rank])
        local = {"model": {**state["model"], "w": state["model"]["w"][start:start + sizes[rank]]},
                 "optim": {"w_m": state["optim"]["w_m"][start:start + sizes[rank]]}, "step": state["step"]}
        save_distributed(local, str(path), rank, world_size, spec)
    return path


def dcp_state():
    g = torch.Generator().manual_seed(5)
    return {"model.w": torch.randn(10, 6, generator=g), "model.b": torch.randn(6, generator=g).to(torch.bfloat16),
            "optim.step": torch.tensor(4.0)}


def dcp_save_rank(rank, world_size, path):
    """dcp.save of :func:`dcp_state` on this Gloo rank: ``model.w`` as a DTensor sharded on dim 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = dcp_state()
    sharded = {**state, "model.w": distribute_tensor(state["model.w"], mesh, [Shard(0)])}
    dcp.save(sharded, checkpoint_id=path)
    return True

"""Run a function on N real Gloo ranks for a test (see shardkit.launch).

``run_ranks(fn, 4, tmp_path, extra)`` calls ``fn(rank, world_size, extra)`` on
four processes with the default process group initialised, and returns the
results ordered by rank; a failing rank fails the test with its traceback.
"""

from __future__ import annotations

from shardkit.launch import run_local_ranks


def run_ranks(fn, world_size, tmp_path, *args, timeout_s=240):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return their results."""
    try:
        return run_local_ranks(fn, world_size, *args, timeout_s=timeout_s, workdir=str(tmp_path))
    except RuntimeError as e:
        raise AssertionError(str(e)) from None

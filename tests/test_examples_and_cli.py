"""The examples run, the CLI answers, and the benchmark harness works at a smoke size."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed
from shardkit.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_and_reshard_example_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "save_and_reshard.py"), str(tmp_path / "ck")],
        capture_output=True, text=True, check=True,
    )
    assert "valid: True" in out.stdout and "rank 2 of 3" in out.stdout


def _saved(tmp_path):
    path = tmp_path / "ck"
    spec = ShardMetadata(1, {"w": TensorShardSpec((4, 2), 0, (4,))})
    save_distributed({"w": torch.ones(4, 2), "step": 5}, str(path), 0, 1, spec)
    return path


def test_cli_inspect_and_validate(tmp_path, capsys):
    path = _saved(tmp_path)
    assert cli_main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_ranks"] == 1 and summary["objects"] == {"step": 5}
    assert cli_main(["validate", str(path)]) == 0
    (path / "rank_0.safetensors").write_bytes(b"x")
    assert cli_main(["validate", str(path)]) == 1
    assert "problem" in capsys.readouterr().out


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert cli_main(["inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_benchmark_harness_smoke(tmp_path):
    from shardkit.bench.runner import main as bench_main

    out = tmp_path / "rows.json"
    assert bench_main(["--size", "1MiB", "--reps", "1", "--only", "save,load", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    impls = {(r["case"], r["impl"]) for r in rows}
    assert ("save, 1 rank, fsync'd", "shardkit") in impls
    assert all(r["median_s"] > 0 for r in rows)

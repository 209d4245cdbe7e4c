"""The load-any benchmark suite (issue 30's rows) runs end to end at a smoke size: both cases, a shardkit row
each, the loaded bytes equal between implementations (no time asserted)."""

import pytest

from shardkit.bench.checkpoint_suites.load_any_bench import run_load_any_benchmarks


@pytest.mark.slow
@pytest.mark.multiproc
def test_load_any_bench_runs_and_both_implementations_load_the_same_bytes(tmp_path):
    rows = run_load_any_benchmarks(1 << 20, 1, str(tmp_path))
    ours = [r for r in rows if r["impl"] == "shardkit"]
    assert len(rows) == 5 and len(ours) == 2                # hf: + the floor row
    assert all(r["same_bytes"] for r in ours)
    hf = ours[0]                                # requested: data rows plus the 4 files' headers
    assert all(req <= 1.1 * share + (64 << 10) for req, share in zip(hf["requested_bytes"], hf["share_bytes"]))
    assert all(r["median_s"] > 0 and r["calls"] == 3 for r in rows)

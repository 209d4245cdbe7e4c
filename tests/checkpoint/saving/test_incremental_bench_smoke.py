"""``shardkit bench --only incremental`` at a tiny size: the suite runs, and its byte counts hold.

No time is asserted (speed lives in ``shardkit bench``); the bytes each save wrote are.
"""

from __future__ import annotations

from shardkit.bench.checkpoint_suites.incremental_bench import CHANGED, FLOOR, TENSORS, run_incremental_benchmarks


def test_incremental_suite_runs_and_writes_only_the_changed_bytes(tmp_path):
    rows = run_incremental_benchmarks(4 << 20, 1, str(tmp_path))
    by = {(r["case"], r["impl"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert len(cases) == 4 and all(r["median_s"] > 0 for r in rows)
    few, every, same, scattered = cases
    inc = by[(few, "shardkit")]
    assert inc["changed_bytes"] == (4 << 20) // TENSORS * CHANGED
    assert inc["bytes_written"] <= 1.1 * inc["changed_bytes"]          # the 1.1x target, in bytes
    assert by[(few, "full save (no base)")]["bytes_written"] >= 4 << 20
    floor = by[(few, FLOOR)]                                           # interleaved beside them, named a floor
    assert floor["kind"] == "limit" and inc["changed_bytes"] <= floor["bytes_written"] <= 1.1 * inc["changed_bytes"]
    assert "not an implementation" in floor["note"] and (every, FLOOR) not in by
    assert by[(every, "shardkit")]["bytes_written"] == by[(every, "full save (no base)")]["bytes_written"]
    assert by[(same, "shardkit")]["note"] == "references 1 earlier steps"
    assert by[(scattered, "shardkit")]["note"] == "references 20 earlier steps"

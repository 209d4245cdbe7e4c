"""``shardkit bench --only incremental`` at a tiny size: the suite runs, and its byte counts hold.

No time is asserted (speed lives in ``shardkit bench``); the bytes each save wrote are.
"""

from __future__ import annotations

import torch

from shardkit.bench.checkpoint_suites.incremental_bench import (CHANGED, FLOOR, RAW_CHAIN, RAW_FULL, TENSORS,
                                                              raw_reads, run_incremental_benchmarks)
import shardkit.checkpoint as ck


def test_incremental_suite_runs_and_writes_only_the_changed_bytes(tmp_path):
    rows = run_incremental_benchmarks(4 << 20, 1, str(tmp_path))
    by = {(r["case"], r["impl"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert len(cases) == 9 and all(r["median_s"] > 0 for r in rows)
    few, every, background, *chains = cases
    caches = ("cold", "warm, cached by a load", "warm, cached by read()")
    assert all(case.endswith(", " + cache) for case, cache in zip(chains, caches * 2))
    in_background = by[(background, "shardkit")]
    assert in_background["bytes_written"] <= 1.1 * in_background["changed_bytes"]
    assert (background, "full async_save (no base)") in by
    inc = by[(few, "shardkit")]
    assert inc["changed_bytes"] == (4 << 20) // TENSORS * CHANGED
    assert inc["bytes_written"] <= 1.1 * inc["changed_bytes"]          # the 1.1x target, in bytes
    assert by[(few, "full save (no base)")]["bytes_written"] >= 4 << 20
    floor = by[(few, FLOOR)]                                           # interleaved beside them, named a floor
    assert floor["kind"] == "limit" and inc["changed_bytes"] <= floor["bytes_written"] <= 1.1 * inc["changed_bytes"]
    assert "not an implementation" in floor["note"] and (every, FLOOR) not in by
    assert by[(every, "shardkit")]["bytes_written"] == by[(every, "full save (no base)")]["bytes_written"]
    for same, scattered in zip(chains[:3], chains[3:]):
        assert by[(same, "shardkit")]["note"] == "references 1 earlier steps"
        assert by[(scattered, "shardkit")]["note"] == "references 20 earlier steps"
    for case in chains:                                                # the raw reads are limits, not peers
        assert by[(case, RAW_CHAIN)]["kind"] == by[(case, RAW_FULL)]["kind"] == "limit"


def test_raw_reads_follow_references_and_read_the_saved_bytes(tmp_path):
    state = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.int64)}
    ck.save(state, str(tmp_path / "s0"))
    state["b"] += 1
    ck.save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    out = {n: torch.zeros_like(t) for n, t in state.items()}
    raw_reads(str(tmp_path / "s1"), out)
    assert all(torch.equal(out[n], state[n]) for n in state)

"""Version-3 compact grid entries on real Gloo ranks: FSDP2 / HSDP / FSDP x TP saves on 4 ranks, loaded on 3
and 2 bit for bit like DCP (the oracle), and validated."""

from __future__ import annotations

import json

import pytest
from ranks import run_ranks
from dtensor_jobs import compact_save_job, load_compare_job
from shardkit.checkpoint import validate_distributed

pytestmark = pytest.mark.multiproc


def test_compact_fsdp2_saves_load_on_other_world_sizes(tmp_path):
    run_ranks(compact_save_job, 4, tmp_path, str(tmp_path), ["fsdp", "hsdp", "fsdp_tp"])
    for kind in ("fsdp", "hsdp", "fsdp_tp"):
        assert validate_distributed(tmp_path / kind / "shardkit").ok
    meta = json.loads((tmp_path / "fsdp" / "shardkit" / "metadata.json").read_text())
    assert meta["format_version"] == 3
    grids = [s["grid"] for s in meta["tensor_specs"].values() if "grid" in s]
    assert grids and any(g["splits"][0] == {"chunk": [4]} for g in grids), meta["tensor_specs"]
    for per_rank in run_ranks(load_compare_job, 3, tmp_path, str(tmp_path), ["fsdp", "hsdp", "fsdp_tp"]):
        for kind, r in per_rank.items():
            assert r["mismatched"] == [] and r["step"] == 1, (kind, r)
    for per_rank in run_ranks(load_compare_job, 2, tmp_path, str(tmp_path), ["fsdp"]):
        assert per_rank["fsdp"]["mismatched"] == []

"""Incremental saves on 2 real Gloo ranks (DTensor leaves sharded over both), loaded on other world sizes."""

from __future__ import annotations

import json

import pytest
import torch

from incremental_jobs import full_state, save_chain_job
from ranks import run_ranks
import shardkit.checkpoint as ck
from shardkit.checkpoint import load_distributed, validate_distributed

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_two_rank_chain_references_both_ranks_files_and_loads_anywhere(tmp_path, background):
    root = str(tmp_path / "run")
    results = run_ranks(save_chain_job, 2, tmp_path, root, background)
    if background:   # each rank's staging buffers proved its unchanged chunks: only changed ones met the base file
        assert all(all(set(c) <= {"head", "bias"} for c in r["compared"]) for r in results), results
    m = json.load(open(f"{root}/step-2/metadata.json"))
    assert m["format_version"] == 3
    referenced = {(c["file"], m["bases"][c["base"]]["dir"]) for t in m["tensor_specs"].values()
                  for c in t["chunks"] if "base" in c}
    # w and emb never change: both ranks' chunks of them point at step 0's two files
    assert ("rank_0.safetensors", "step-0") in referenced and ("rank_1.safetensors", "step-0") in referenced
    assert all("base" not in c for c in m["tensor_specs"]["bias"]["chunks"])   # changed at step 2
    for step in range(3):
        d = f"{root}/step-{step}"
        assert validate_distributed(d).ok
        expected = full_state(step)
        out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()}
        ck.load(out, d)                                   # one process: another world size
        for k, v in expected.items():
            assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, (step, k)
        parts = [load_distributed(d, r, 3) for r in range(3)]   # three ranks
        assert all(torch.equal(p["bias"], expected["bias"]) for p in parts)

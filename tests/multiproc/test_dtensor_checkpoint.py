"""shardkit.checkpoint.save / load with DTensor state dicts (FSDP2, HSDP, FSDP x TP) and DDP, on Gloo ranks.

The oracle is DCP itself: the same job saves with ``shardkit.checkpoint.save``
and with ``dcp.save``; loading each into FSDP2 on another world size (via
``get_state_dict`` / ``set_state_dict``) must give the same parameters and
Adam moments, bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
from ranks import run_ranks
from dtensor_jobs import ddp_load_job, ddp_save_job, load_compare_job, save_job, train_loop_job
from shardkit.checkpoint import validate_distributed

pytestmark = pytest.mark.multiproc


def _check(results, kinds):
    for per_rank in results:
        for kind in kinds:
            r = per_rank[kind]
            assert r["mismatched"] == [], (kind, r)
            assert r["step"] == 1 and r["moments"] >= 4, r
            assert r["losses"][0] == r["losses"][1], r


def test_fsdp2_4_ranks_loads_on_2_and_3_like_dcp(tmp_path):
    run_ranks(save_job, 4, tmp_path, str(tmp_path), ["fsdp", "hsdp", "fsdp_tp"])
    for kind in ("fsdp", "hsdp", "fsdp_tp"):
        report = validate_distributed(tmp_path / kind / "shardkit")
        assert report.ok, str(report)
        meta = json.loads((tmp_path / kind / "shardkit" / "metadata.json").read_text())
        assert meta["format_version"] == 3
        for name, spec in meta["tensor_specs"].items():
            boxes = [(tuple(c["offsets"]), tuple(c["sizes"])) for c in spec["chunks"]]
            assert len(boxes) == len(set(boxes)), (kind, name)       # each distinct box once
    _check(run_ranks(load_compare_job, 3, tmp_path, str(tmp_path), ["fsdp", "hsdp", "fsdp_tp"]),
           ["fsdp", "hsdp", "fsdp_tp"])
    _check(run_ranks(load_compare_job, 2, tmp_path, str(tmp_path), ["fsdp"]), ["fsdp"])


def test_replicated_boxes_written_once_and_spread(tmp_path):
    run_ranks(save_job, 4, tmp_path, str(tmp_path), ["hsdp"])
    meta = json.loads((tmp_path / "hsdp" / "shardkit" / "metadata.json").read_text())
    writers = {c["file"] for spec in meta["tensor_specs"].values() for c in spec["chunks"]}
    assert len(writers) >= 3, writers   # 2 replicas of each box: the writing is spread over ranks


def test_ddp_plain_tensors_3_to_2_and_rank_state(tmp_path):
    saved = run_ranks(ddp_save_job, 3, tmp_path, str(tmp_path))
    meta = json.loads((tmp_path / "ddp" / "metadata.json").read_text())
    specs = meta["tensor_specs"]
    assert all(len(s["chunks"]) == 1 for n, s in specs.items() if not n.startswith("__rank_state__"))  # once
    assert len(specs["__rank_state__.rng"]["chunks"]) == 3     # one row per rank
    for step, values, (rng, pos, warned) in run_ranks(ddp_load_job, 2, tmp_path, str(tmp_path)):
        assert step == 3
        assert values.keys() == saved[0].keys()
        for n, t in values.items():
            assert t == saved[0][n], n
        assert (rng, pos) == ([-1] * 4, -1) and warned      # another world size: rank_state untouched, warned
    for rank, (_, _, (rng, pos, warned)) in enumerate(run_ranks(ddp_load_job, 3, tmp_path, str(tmp_path))):
        assert (rng, pos, warned) == ([rank] * 4, 10 * rank, [])   # same world size: each rank its own values


def test_training_resumes_on_another_world_size_with_the_same_losses(tmp_path):
    """4 ranks train steps 0..5 (saving every 2), the job ends; 2 ranks resume and train to 8.
    The losses of steps 6..7 equal those of an uninterrupted 4-rank run of 0..7."""
    straight = run_ranks(train_loop_job, 4, tmp_path, str(tmp_path / "a"), 0, 8, 100)[0][1]
    first = run_ranks(train_loop_job, 4, tmp_path, str(tmp_path / "b"), 0, 6, 2)
    assert first[0][0] is None and sorted(first[0][1]) == list(range(6))
    assert sorted(os.listdir(tmp_path / "b")) == ["step-3", "step-5"]          # keep_last=2
    resumed = run_ranks(train_loop_job, 2, tmp_path, str(tmp_path / "b"), 0, 8, 100)
    for step_from, losses in resumed:
        assert step_from == 5 and sorted(losses) == [6, 7]
        assert [losses[s] for s in (6, 7)] == [straight[s] for s in (6, 7)], (losses, straight)

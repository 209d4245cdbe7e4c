"""The chunked save's compact layout on real DTensors (Gloo ranks): every rank's predicted box is the
box it holds, the save takes the compact path, and metadata.json holds the boxes the full exchange
of every rank's boxes would give, each written by a rank that holds it."""

from __future__ import annotations

import json

import pytest
import torch
from layout_jobs import layout_job, model_kinds_job
from ranks import run_ranks

import shardkit.checkpoint as ckpt

pytestmark = pytest.mark.multiproc

SEEDS = list(range(4))


def test_random_meshes_predict_every_box_and_save_on_the_compact_path(tmp_path):
    results = run_ranks(layout_job, 4, tmp_path, str(tmp_path), SEEDS)
    for seed in SEEDS:
        per_rank = [r[seed] for r in results]
        assert all(r["agree"] for r in per_rank), seed
        assert [r["collectives"] for r in per_rank] == [6] * 4, seed       # no fallback exchange
        directory = tmp_path / f"s{seed}"
        assert ckpt.validate_distributed(directory).ok
        meta = json.loads((directory / "metadata.json").read_text())
        reports = per_rank[0]["reports"]
        for name, spec in meta["tensor_specs"].items():
            got = sorted((tuple(c["offsets"]), tuple(c["sizes"])) for c in spec["chunks"])
            assert got == [tuple(map(tuple, b)) for b in per_rank[0]["boxes"][name]], (seed, name)
            for c in spec["chunks"]:          # written by a rank that holds that box
                writer = int(c["file"].split("_")[1].split(".")[0])
                assert tuple(reports[writer][name][2:]) == (tuple(c["offsets"]), tuple(c["sizes"])), (seed, name)
        full = ckpt.load_consolidated(directory)
        assert torch.equal(full["plain"], torch.arange(5, dtype=torch.float64))
        for name, t in full.items():
            if name != "plain":
                i = int(name[1:])
                assert torch.equal(t.flatten(), torch.arange(t.numel(), dtype=torch.float32) + 100 * i), (seed, name)


def test_fsdp2_hsdp_and_tp_models_save_on_the_compact_path(tmp_path):
    results = run_ranks(model_kinds_job, 4, tmp_path, str(tmp_path), ["fsdp", "hsdp", "fsdp_tp"])
    for kind in ("fsdp", "hsdp", "fsdp_tp"):
        assert [r[kind] for r in results] == [6] * 4, kind
        assert ckpt.validate_distributed(tmp_path / kind).ok

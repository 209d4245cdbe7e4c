"""Distributed checkpoints on a real S3 server (SeaweedFS, see conftest.py).

Save on 4 Gloo ranks and load on 3 (bytes each loading rank downloads
counted), validation, a save killed part-way, clean-up of what it left, and
the CLI's ``inspect`` / ``validate`` on ``s3://`` URLs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ranks import run_ranks
from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    load_distributed,
    save_distributed,
    validate_distributed,
)
from shardkit.storage import fetched_bytes, storage_for

ROWS, COLS = 1200, 512  # 2.3 MiB of float32, sharded on dim 0


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(ROWS, COLS, generator=g) if name == "w" else torch.arange(COLS * 3, dtype=torch.int64)


def _save_then_load(rank: int, world_size: int, url: str, env: dict) -> dict:
    import torch.distributed as dist

    os.environ.update(env)  # a forkserver started before the S3 fixture did not inherit it

    sizes = compute_shard_sizes(ROWS, world_size)
    start = sum(sizes[:rank])
    state = {"model": {"w": _full("w")[start : start + sizes[rank]].clone(), "ids": _full("ids")}, "step": 7}
    spec = ShardMetadata(world_size, {"model.w": TensorShardSpec((ROWS, COLS), 0, tuple(sizes))})
    save_distributed(state, url, rank, world_size, spec, group=dist.group.WORLD)
    dist.barrier()
    if rank >= 3:  # load on 3 ranks: loading needs no collective
        return {}
    before = fetched_bytes()
    out = load_distributed(url, rank, 3)
    fetched = fetched_bytes() - before
    output = sum(t.numel() * t.element_size() for t in out["model"].values())
    sizes3 = compute_shard_sizes(ROWS, 3)
    start3 = sum(sizes3[:rank])
    equal = (torch.equal(out["model"]["w"], _full("w")[start3 : start3 + sizes3[rank]])
             and torch.equal(out["model"]["ids"], _full("ids")) and out["step"] == 7)
    return {"equal": equal, "fetched": fetched, "output": output}  # tensors do not cross the queue


@pytest.mark.multiproc
def test_save_on_4_ranks_load_on_3_downloads_only_what_each_rank_needs(s3_url, s3_env, tmp_path):
    results = run_ranks(_save_then_load, 4, tmp_path, s3_url, s3_env)
    assert validate_distributed(s3_url).ok
    for rank, res in enumerate(results[:3]):
        assert res["equal"], rank
        # the manifest and headers are a few KiB; the tensor bytes are exactly the output
        assert res["fetched"] <= 1.1 * res["output"], (rank, res["fetched"], res["output"])


def test_validate_reports_a_missing_and_a_truncated_object(s3_url, s3fs_client):
    state = {"a": torch.arange(1000.0), "b": torch.ones(3, 3)}
    save_distributed(state, s3_url, 0, 1, None)
    assert validate_distributed(s3_url).ok
    out = load_distributed(s3_url, 0, 1)
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    key = s3_url[len("s3://"):] + "/rank_0.safetensors"
    data = s3fs_client.cat(key)
    s3fs_client.pipe(key, data[:-100])
    report = validate_distributed(s3_url)
    assert not report.ok and any("rank_0.safetensors" in p for p in report.problems)
    s3fs_client.rm(key)
    assert not validate_distributed(s3_url).ok


@pytest.mark.parametrize("at", ["mid_upload", "before_manifest"])
def test_a_save_killed_part_way_leaves_the_previous_checkpoint_valid_and_itself_invalid(s3_url, s3fs_client, at):
    old, new = s3_url + "/step-1", s3_url + "/step-2"
    state = {"w": torch.full((1000,), 1.0), "step": 1}
    save_distributed(state, old, 0, 1, None)
    child = os.path.join(os.path.dirname(__file__), "kill_child.py")
    proc = subprocess.run([sys.executable, child, new, at], capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert validate_distributed(old).ok
    assert torch.equal(load_distributed(old, 0, 1)["w"], state["w"])
    report = validate_distributed(new)
    assert not report.ok
    store, root = storage_for(new)
    names = store.listdir(root)
    assert "metadata.json" not in names
    if at == "mid_upload":
        assert "rank_0.safetensors" not in names  # the unfinished upload is invisible
        removed = store.remove_orphans(root)
        assert any("incomplete upload" in r for r in removed), removed
        assert store.remove_orphans(root) == []
    else:
        assert "rank_0.safetensors" in names  # a complete data object, but no manifest


def test_cli_inspect_and_validate_take_s3_urls(s3_url, capsys):
    from shardkit.cli import main

    save_distributed({"w": torch.ones(4, 4), "lr": 0.1}, s3_url, 0, 1, None)
    assert main(["inspect", s3_url]) == 0
    shown = capsys.readouterr().out
    assert "rank_0.safetensors" in shown and "distributed checkpoint" in shown
    assert main(["validate", s3_url]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["validate", s3_url + "-absent"]) != 0


def test_a_missing_bucket_is_a_typed_error_and_is_never_created(s3_server, s3fs_client):
    import uuid

    from shardkit.checkpoint import CheckpointManager, save
    from shardkit.errors import MissingShardError

    bucket = f"nosuch-{uuid.uuid4().hex[:8]}"
    with pytest.raises(MissingShardError, match=f"bucket '{bucket}'.*does not exist.*Create it first"):
        save({"w": torch.ones(2)}, f"s3://{bucket}/ck")
    with pytest.raises(MissingShardError, match=f"bucket '{bucket}'"):
        CheckpointManager(f"s3://{bucket}/run")
    assert not s3fs_client.exists(bucket)   # was: created, so a mistyped name went unnoticed

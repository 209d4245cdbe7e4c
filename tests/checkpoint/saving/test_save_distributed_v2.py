"""``save_distributed`` writes format version 2 (the one chunked engine); without a group the last rank commits."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_helpers import save_full_v1
from shardkit.checkpoint import (ShardMetadata, TensorShardSpec, load_consolidated, load_distributed, read_metadata,
                                 save_distributed, validate_distributed)
from shardkit.checkpoint.planning.plan import split_spec
from shardkit.offline import reshard_checkpoint

W = torch.arange(40.0).reshape(10, 4)
SPEC = ShardMetadata(3, {"w": TensorShardSpec((10, 4), 0, (5, 0, 5))})
ROWS = {0: W[:5], 1: W[5:5], 2: W[5:]}


def _save(directory, rank, step=1, **kw):
    save_distributed({"w": ROWS[rank], "b": torch.ones(3), "step": step}, directory, rank, 3, SPEC, **kw)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_the_last_rank_to_finish_commits_every_file(tmp_path, order):
    for i, rank in enumerate(order):
        assert not (tmp_path / "metadata.json").exists()      # never before every rank's file is there
        _save(tmp_path, rank)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["format_version"] == 3 and sorted(meta["files"]) == [f"rank_{r}.safetensors" for r in range(3)]
    assert meta["tensor_specs"]["w"]["shard_dim"] == 0 and "shard_dim" not in meta["tensor_specs"]["b"]
    assert [c["file"] for c in meta["tensor_specs"]["w"]["chunks"]] == ["rank_0.safetensors", "rank_2.safetensors"]
    assert validate_distributed(tmp_path).ok
    for rank in range(3):   # the saved (uneven, empty) slices on the same world size
        assert torch.equal(load_distributed(tmp_path, rank, 3)["w"], ROWS[rank])
    assert torch.equal(load_distributed(tmp_path, 1, 2)["w"], W[5:])   # an even split on another
    assert split_spec(read_metadata(tmp_path).tensors["w"], 3) == SPEC.tensor_specs["w"]


def test_a_record_of_another_save_completes_nothing(tmp_path):
    for rank in range(3):
        _save(tmp_path / "a", rank, step=1)
    for rank in (0, 1):     # step 2 over step 1: rank 2's record is step 1's
        _save(tmp_path / "a", rank, step=2, overwrite=True)
    assert not (tmp_path / "a" / "metadata.json").exists() and not validate_distributed(tmp_path / "a").ok
    _save(tmp_path / "a", 2, step=2, overwrite=True)
    assert load_consolidated(tmp_path / "a")["step"] == 2 and validate_distributed(tmp_path / "a").ok


def test_with_a_group_the_layout_disagreement_touches_nothing(tmp_path):
    from shardkit.comm import Group
    from comm_threads import on_threads

    groups = Group.local(2, timeout=30)
    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})

    def one(g):
        try:
            state = {"w": torch.ones(2), ("x" if g.rank else "y"): torch.ones(1)}   # names differ
            save_distributed(state, tmp_path, g.rank, 2, spec, group=g)
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    try:
        errors = on_threads(groups, one)
    finally:
        for g in groups:
            g.close()
    assert all("disagree" in str(e) for e in errors)
    assert not any(tmp_path.iterdir())


def test_reshard_of_a_version_1_checkpoint_writes_version_2(tmp_path):
    full = torch.randn(7, 5)
    save_full_v1({"w": full, "r": torch.arange(3)}, tmp_path / "v1", 2, {"w": 1})
    assert read_metadata(tmp_path / "v1").format_version == 1
    reshard_checkpoint(str(tmp_path / "v1"), str(tmp_path / "v2"), 3)
    m = read_metadata(tmp_path / "v2")
    assert m.format_version == 3 and m.tensors["w"].split_dim == 1 and m.tensors["r"].split_dim is None
    assert [c.box.sizes[1] for c in m.tensors["w"].chunks] == [2, 2, 1]
    assert torch.equal(load_consolidated(tmp_path / "v2")["w"], full)
    assert torch.equal(load_distributed(tmp_path / "v2", 2, 3)["w"], full[:, 4:])


def test_ranks_saving_at_once_without_a_group_leave_one_complete_checkpoint(tmp_path):
    import threading

    errors = []

    def one(rank):
        try:
            _save(tmp_path, rank)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["w"], W)


def test_a_split_tensor_without_an_element_loads_in_the_shapes_it_was_saved_in(tmp_path):
    # No chunk records its sizes (it has no byte), so the metadata does: rank 1 saved the one row.
    spec = ShardMetadata(2, {"w": TensorShardSpec((1, 0), 0, (0, 1))})
    for rank, rows in enumerate((0, 1)):
        save_distributed({"w": torch.empty(rows, 0)}, tmp_path, rank, 2, spec)
    assert json.loads((tmp_path / "metadata.json").read_text())["tensor_specs"]["w"]["shard_sizes"] == [0, 1]
    assert [tuple(load_distributed(tmp_path, r, 2)["w"].shape) for r in range(2)] == [(0, 0), (1, 0)]
    assert [tuple(load_distributed(tmp_path, r, 3)["w"].shape) for r in range(3)] == [(1, 0), (0, 0), (0, 0)]

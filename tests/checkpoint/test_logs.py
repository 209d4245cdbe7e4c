"""The checkpoint API says what it did through logging (logger ``shardkit.checkpoint``)."""

import logging

import pytest
import torch

import shardkit.checkpoint as ckpt
from shardkit.errors import MissingShardError


def test_saves_loads_and_validation_log_their_target_and_time(tmp_path, caplog):
    path = str(tmp_path / "ck")
    with caplog.at_level(logging.INFO, logger="shardkit.checkpoint"):
        ckpt.save({"w": torch.ones(3)}, path)
        ckpt.load({"w": torch.empty(3)}, path)
        ckpt.load_distributed(path, 0, 1)
        assert ckpt.validate_distributed(path).ok
    messages = [r.getMessage() for r in caplog.records if r.name == "shardkit.checkpoint"]
    assert [m.split(":")[0] for m in messages] == [
        f"save {path}", f"load {path}", f"load_distributed {path} (rank 0 of 1)", f"validate {path}"]
    assert all(" s" in m and "done in" in m for m in messages)


def test_a_failure_is_logged_with_its_type_and_still_raised(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="shardkit.checkpoint"), pytest.raises(MissingShardError):
        ckpt.load({"w": torch.empty(3)}, str(tmp_path / "missing"))
    assert "failed after" in caplog.text and "MissingShardError" in caplog.text


def test_the_decorated_functions_keep_their_docstrings_and_signatures():
    import inspect

    assert "dcp" in ckpt.save.__doc__.lower() or ckpt.save.__doc__
    assert list(inspect.signature(ckpt.load_distributed).parameters)[:3] == ["dir", "rank", "world_size"]


def test_validate_reports_progress_by_data_file(tmp_path):
    path = str(tmp_path / "ck")
    for rank in range(3):
        ckpt.save_distributed({"w": torch.full((100,), float(rank))}, path, rank, 3,
                              ckpt.ShardMetadata(3, {"w": ckpt.TensorShardSpec((300,), 0, (100, 100, 100))}))
    calls = []
    assert ckpt.validate_distributed(path, progress=lambda advance, total: calls.append((advance, total))).ok
    assert len(calls) == 3 and sum(a for a, _ in calls) == calls[0][1]

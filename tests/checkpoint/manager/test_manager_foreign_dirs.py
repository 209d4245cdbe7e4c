"""``CheckpointManager`` never deletes what it did not write.

A torchtitan run folder holds DCP ``step-N`` directories (``.metadata`` and
``__r_0.distcp``), maybe a Hugging Face export under a step name and a user's
notes; a manager pointed at it saves beside them, rotates only its own steps,
and leaves every byte of theirs as it was (logging once why).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from shardkit.checkpoint import CheckpointManager, save
from shardkit.checkpoint.format.ownership import OWNER_FILE
from shardkit.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(v: float) -> dict:
    return {"w": torch.full((8, 4), v), "step": int(v)}


def _snapshot(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256 of its bytes)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _torchtitan_folder(root) -> dict[str, str]:
    """DCP steps 5 and 10, an HF export as step-7, a user's notes in step-3; their snapshot."""
    for step in (5, 10):
        dcp.save({"model": {"w": torch.full((8, 4), float(step))}}, checkpoint_id=str(root / f"step-{step}"),
                 no_dist=True)
    hf = root / "step-7"
    hf.mkdir()
    save_file({"w": torch.ones(8, 4)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "step-3").mkdir()
    (root / "step-3" / "NOTES.txt").write_text("lr sweep: 3e-4 diverged\n")
    return _snapshot(root)


@pytest.mark.parametrize("async_save", [True, False])
def test_rotation_leaves_other_tools_steps_and_user_files_alone(tmp_path, caplog, async_save):
    theirs = _torchtitan_folder(tmp_path)
    caplog.set_level(logging.WARNING, logger="shardkit.checkpoint.manager.checkpoint_manager")
    with CheckpointManager(tmp_path, keep_last=1, async_save=async_save) as mgr:
        for step in (11, 12, 13):
            mgr.save(step, _state(step))
            mgr.wait()
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in theirs} == theirs       # every byte of theirs, as it was
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-13", "step-3", "step-5", "step-7"]
    for step in (3, 5, 7, 10):                                              # each named once, with why
        said = [r.getMessage() for r in caplog.records if f"step-{step} alone" in r.getMessage()]
        assert len(said) == 1 and "did not write it" in said[0], said


def test_saving_into_a_step_that_holds_foreign_files_is_refused_and_touches_nothing(tmp_path):
    theirs = _torchtitan_folder(tmp_path)
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        for step, found in ((3, "NOTES.txt"), (7, "config.json")):
            with pytest.raises(CheckpointError, match=f"holds files shardkit did not write.*{found}"):
                mgr.save(step, _state(step))
    assert _snapshot(tmp_path) == theirs


def test_a_crashed_save_is_recognised_by_its_mark_and_removed(tmp_path):
    crashed = tmp_path / "step-1"
    crashed.mkdir()
    (crashed / OWNER_FILE).write_text("{}")
    (crashed / "rank_0.safetensors").write_bytes(b"half a file")
    unmarked = tmp_path / "step-2"                   # shardkit's names, but nothing proves a save wrote them
    unmarked.mkdir()
    (unmarked / "rank_0.safetensors").write_bytes(b"someone's file")
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(3, _state(3))
        mgr.wait()
        assert mgr.steps() == [3]
    assert not crashed.exists() and (unmarked / "rank_0.safetensors").read_bytes() == b"someone's file"


def test_files_a_user_added_to_an_own_step_outlive_its_rotation(tmp_path, caplog):
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        (tmp_path / "step-1" / "eval.txt").write_text("acc 0.71\n")
        mgr.save(2, _state(2))
        mgr.wait()
        assert mgr.steps() == [2]
    assert os.listdir(tmp_path / "step-1") == ["eval.txt"]
    assert any("kept what it did not write there: eval.txt" in r.getMessage() for r in caplog.records)


def test_a_manager_save_marks_its_directory_and_a_plain_save_does_not(tmp_path):
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, _state(1))
    assert json.loads((tmp_path / "run" / "step-1" / OWNER_FILE).read_text())["format"] == "shardkit.distributed"
    save(_state(1), tmp_path / "plain")
    assert sorted(os.listdir(tmp_path / "plain")) == ["metadata.json", "rank_0.safetensors"]


def test_restore_resumes_from_a_torchtitan_dcp_step_then_the_managers_own_steps_follow(tmp_path):
    theirs = _torchtitan_folder(tmp_path)
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        assert mgr.steps() == [5, 7, 10] and mgr.latest_step() == 10     # DCP and HF steps count; notes do not
        state = {"model": {"w": torch.zeros(8, 4)}}
        assert mgr.restore(state) == 10
        assert torch.equal(state["model"]["w"], torch.full((8, 4), 10.0))
        with pytest.raises(CheckpointError, match="step 10 is saved"):   # below a newer complete step: refused
            mgr.save(9, state)
        for step in (11, 12):
            mgr.save(step, {"model": {"w": torch.full((8, 4), float(step))}})
            mgr.wait()
        assert mgr.steps() == [5, 7, 10, 12] and mgr.restore(state) == 12
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in theirs} == theirs

"""CheckpointManager: complete steps only, rotation, best, crash leftovers, one save at a time."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from shardkit.checkpoint import CheckpointManager, validate_distributed
from shardkit.checkpoint.format.ownership import OWNER_FILE
from shardkit.errors import CheckpointError, CheckpointExistsError, MetadataError


def _state(v: float, step: int = 0):
    return {"w": torch.full((3, 4), v), "step": step}


@pytest.mark.parametrize("async_save", [True, False])
def test_rotation_keeps_last_and_best(tmp_path, async_save):
    with CheckpointManager(tmp_path, keep_last=2, best=("loss", "min"), async_save=async_save) as mgr:
        for step, loss in [(1, 5.0), (2, 0.5), (9, 3.0), (10, 4.0), (11, 6.0)]:
            mgr.save(step, _state(step, step), metrics={"loss": loss})
        mgr.wait()
        assert mgr.steps() == [2, 10, 11]        # ordered by number (10 after 9), best (2) kept
        assert mgr.latest_step() == 11 and mgr.metrics(2) == {"loss": 0.5}
    target = _state(0)
    assert CheckpointManager(tmp_path).restore(target) == 11
    assert target["step"] == 11 and torch.equal(target["w"], torch.full((3, 4), 11.0))
    assert CheckpointManager(tmp_path).restore(target, step=2) == 2 and target["step"] == 2


def test_best_max_and_fresh_run(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", keep_last=1, best=("acc", "max"), async_save=False)
    assert mgr.restore(_state(0)) is None and mgr.latest_step() is None
    for step, acc in [(1, 0.9), (2, 0.1), (3, 0.2)]:
        mgr.save(step, _state(step), metrics={"acc": acc})
    mgr.close()
    assert mgr.steps() == [1, 3]


def test_incomplete_step_is_ignored_then_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, async_save=False)
    mgr.save(1, _state(1, 1))
    mgr.wait()
    crashed = tmp_path / "step-2"
    crashed.mkdir()
    (crashed / OWNER_FILE).write_text("{}")   # a manager's save marks its directory before any data byte
    (crashed / "rank_0.safetensors").write_bytes(b"half")
    assert mgr.steps() == [1]
    target = _state(0)
    assert mgr.restore(target) == 1
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        mgr.restore(target, step=2)
    mgr.save(3, _state(3, 3))
    mgr.wait()
    assert not crashed.exists() and mgr.steps() == [1, 3]


def test_saving_a_step_again_replaces_a_crashed_one(tmp_path):
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "rank_7.safetensors").write_bytes(b"leftover of a bigger job")
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(4, _state(4, 4))
    assert sorted(os.listdir(tmp_path / "step-4")) == [OWNER_FILE, "metadata.json", "rank_0.safetensors"]


@pytest.mark.parametrize("async_save", [True, False])
def test_saving_a_complete_step_again_is_refused_and_keeps_it(tmp_path, async_save):
    # Before, the step was cleared first: a crash in the new save lost the newest checkpoint.
    with CheckpointManager(tmp_path, keep_last=1, async_save=async_save) as mgr:
        mgr.save(5, _state(5, 5))
        mgr.wait()
        with pytest.raises(CheckpointExistsError, match="step 5 is already saved"):
            mgr.save(5, _state(6, 6))
        assert mgr.steps() == [5]
        target = _state(0)
        assert mgr.restore(target) == 5 and target["w"].eq(5).all()
        mgr.save(6, _state(6, 6))                     # the next step saves as usual
    assert validate_distributed(tmp_path / "step-6").ok


def test_saving_below_a_newer_complete_step_is_refused(tmp_path):
    # After a roll-back to step 7, saving step 8 while step 9 is complete: rotation (by number)
    # deleted step 8 at once with keep_last=1, and restore() resumed from the abandoned step 9.
    with CheckpointManager(tmp_path, keep_last=3, async_save=False) as mgr:
        for step in (7, 9):
            mgr.save(step, _state(step, step))
        target = _state(0)
        assert mgr.restore(target, step=7) == 7
        with pytest.raises(CheckpointError, match="step 9 is saved .* newer than step 8"):
            mgr.save(8, _state(8, 8))
        assert mgr.steps() == [7, 9] and not (tmp_path / "step-8").exists()
        shutil.rmtree(tmp_path / "step-9")                  # what the message says to do
        mgr.save(8, _state(8, 8))
    assert mgr.steps() == [7, 8]


def test_only_canonical_step_names_count(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(12, _state(12, 12))
    for other in ("step-012", "step-\u0661\u0662", "step-12\n"):  # a leading zero, Arabic-Indic digits, a newline
        shutil.copytree(tmp_path / "step-12", tmp_path / other)      # complete copies: each parsed as step 12 before
    mgr = CheckpointManager(tmp_path)
    assert mgr.steps() == [12]                                        # before: [12, 12, 12, 12]
    with pytest.raises(MetadataError, match="10\\*\\*18"):
        mgr.save(10**18, _state(1))
    mgr.close()


def test_second_save_waits_for_the_first(tmp_path, monkeypatch):
    import shardkit.checkpoint.saving.chunked_save as chunked_save

    real, calls = chunked_save.write_safetensors, []

    def slow(*args, **kwargs):
        calls.append("start")
        import time
        time.sleep(0.2)
        calls.append("end")
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked_save, "write_safetensors", slow)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    assert calls == ["start", "end", "start", "end"]
    assert validate_distributed(tmp_path / "step-1").ok and validate_distributed(tmp_path / "step-2").ok


def test_bad_arguments(tmp_path):
    with pytest.raises(MetadataError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(MetadataError, match="best"):
        CheckpointManager(tmp_path, best=("loss", "up"))
    mgr = CheckpointManager(tmp_path)
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(1, _state(1))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigkill_during_a_save_is_ignored_and_cleaned_up(tmp_path, mode):
    child = os.path.join(os.path.dirname(os.path.dirname(__file__)), "manager_crash_child.py")
    proc = subprocess.run([sys.executable, child, str(tmp_path), mode], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert (tmp_path / "step-3" / "rank_0.safetensors").exists()          # killed mid-save
    mgr = CheckpointManager(tmp_path, keep_last=5, async_save=False)
    assert mgr.steps() == [1, 2]
    target = {"w": torch.zeros(1000), "step": 0}
    assert mgr.restore(target) == 2 and target["step"] == 2
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32) + 2)
    mgr.save(4, target)
    mgr.close()
    assert mgr.steps() == [1, 2, 4] and not (tmp_path / "step-3").exists()


def _fail_reads_of(monkeypatch, store, name: str, *, nth: int = 1):
    """Make the ``nth`` read of a file whose path ends with ``name`` fail once with EIO (a transient
    fault, like a server's 500); return the list of paths it failed."""
    original, seen, failed = type(store).read_bytes, [], []

    def flaky(self, path, *, max_bytes):
        if str(path).endswith(name):
            seen.append(path)
            if len(seen) == nth:
                failed.append(path)
                raise OSError(errno.EIO, "injected: transient read failure", str(path))
        return original(self, path, max_bytes=max_bytes)

    monkeypatch.setattr(type(store), "read_bytes", flaky)
    return failed


def test_a_transient_read_failure_is_raised_not_taken_for_an_incomplete_step(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=3, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, _state(step, step))
    mgr.close()
    mgr = CheckpointManager(tmp_path, keep_last=3, async_save=False)
    failed = _fail_reads_of(monkeypatch, mgr._storage, "step-3/metadata.json")
    target = _state(0)
    with pytest.raises(OSError, match="transient"):
        mgr.restore(target)   # was: step 2 restored without a word
    assert failed and target["step"] == 0
    _fail_reads_of(monkeypatch, mgr._storage, "step-3/metadata.json")
    with pytest.raises(OSError, match="transient"):
        mgr.steps()
    assert mgr.restore(target) == 3 and target["step"] == 3   # the fault passed: the newest step


@pytest.mark.parametrize("nth", [1, 2], ids=["completeness_check", "metrics_read"])
def test_a_transient_read_failure_stops_the_rotation_and_keeps_the_best(tmp_path, monkeypatch, caplog, nth):
    mgr = CheckpointManager(tmp_path, keep_last=1, best=("loss", "min"), async_save=False)
    mgr.save(1, _state(1, 1), metrics={"loss": 0.1})   # the best step
    mgr.save(2, _state(2, 2), metrics={"loss": 0.5})
    mgr.wait()
    failed = _fail_reads_of(monkeypatch, mgr._storage, "step-1/metadata.json", nth=nth)
    mgr.save(3, _state(3, 3), metrics={"loss": 0.9})
    mgr.wait()
    assert failed, "the injected fault was never hit"
    assert mgr.steps() == [1, 2, 3]        # was: the best step 1 deleted
    assert "removing old checkpoints failed" in caplog.text and "transient" in caplog.text
    mgr.save(4, _state(4, 4), metrics={"loss": 0.7})   # the next rotation does the work
    mgr.close()
    assert mgr.steps() == [1, 4]


def test_a_read_failure_on_rank_0_while_choosing_the_step_fails_every_rank(tmp_path, monkeypatch):
    from shardkit.comm import Group

    from comm_threads import on_threads

    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(1, 1))
    _fail_reads_of(monkeypatch, mgr._storage, "step-1/metadata.json")

    def restore(g):
        try:
            return CheckpointManager(tmp_path, group=g, async_save=False).restore(_state(0))
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e).__name__, str(e)

    groups = Group.local(2, timeout=30)
    try:
        (kind0, _), (kind1, message1) = on_threads(groups, restore)
    finally:
        for g in groups:
            g.close()
    assert kind0 == "OSError" and kind1 == "CheckpointError"    # neither waits for the other
    assert "rank 0 failed while choosing the step to restore" in message1 and "transient" in message1

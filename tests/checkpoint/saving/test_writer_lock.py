"""One writer per checkpoint directory (``Storage.writer_lock``, ``storage/backends/lock.py``).

Real processes (a forkserver that imported torch once): a save held in the
middle of its data file while a second save starts; a writer SIGKILLed while
it holds the lock; a child forked by a lock holder that outlives it. Then the
lock file's invisibility to validation, listings and clean-up, and a group
save that finds the directory busy.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import threading

import pytest
import torch
from held_writes import hold_writes, held_writer_process

from shardkit.checkpoint import load_consolidated, save_distributed, validate_distributed
from shardkit.errors import CheckpointBusyError
from shardkit.storage import LocalStorage, is_lock_name, is_temp_name, storage_for
from shardkit.storage.backends.lock import lock_file_name, local_writer_lock

HANG_GUARD_S = 60


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "shardkit.checkpoint"])
    return c


def _save_held_mid_write(directory, value, started, release) -> None:
    """Save 1 rank, stopping inside the data file write until ``release`` is released."""
    import shardkit.checkpoint.saving.chunked_save as save_module   # the engine save_distributed writes through

    hold_writes(save_module, started, release, HANG_GUARD_S)
    save_distributed({"w": torch.full((4,), float(value)), "step": value}, directory, 0, 1, None)


def _hold_lock_and_fork(directory, child_pid) -> None:
    with local_writer_lock(directory, holder="parent of a forked child"):
        pid = os.fork()
        if pid == 0:                       # the child: outlives its parent, holding nothing
            signal.pause()
            os._exit(0)
        child_pid.value = pid
        signal.pause()                     # killed here by the test


@pytest.fixture
def held_writer(ctx, tmp_path):
    """A process in the middle of saving into ``tmp_path / "ck"``; yields (process, directory, release)."""
    with held_writer_process(ctx, _save_held_mid_write, str(tmp_path / "ck"), 1, HANG_GUARD_S, "writer") as held:
        yield held


def _in_thread(fn):
    """Run ``fn`` with a hang guard: a lock that waited instead of failing would hang here."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "the second writer blocked instead of failing at once"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_second_writer_fails_at_once_naming_the_first(held_writer):
    p, directory, release = held_writer
    with pytest.raises(CheckpointBusyError) as busy:
        _in_thread(lambda: save_distributed({"w": torch.zeros(4)}, directory, 0, 1, None))
    message = str(busy.value)
    assert f"pid {p.pid} on host {socket.gethostname()}" in message
    assert "writing since" in message and "save_distributed rank 0 of 1" in message
    assert "another directory" in message
    release.release()
    p.join(HANG_GUARD_S)
    assert p.exitcode == 0
    assert validate_distributed(directory).ok                       # the first save was not disturbed
    assert torch.equal(load_consolidated(directory)["w"], torch.full((4,), 1.0))
    assert not any(is_lock_name(n) for n in os.listdir(directory))  # released: nothing left behind


def test_a_busy_directory_refuses_an_hf_save_too(held_writer):
    from shardkit.hf import save_checkpoint

    p, directory, _ = held_writer
    with pytest.raises(CheckpointBusyError, match=f"pid {p.pid}"):
        _in_thread(lambda: save_checkpoint(directory, {"w": torch.zeros(2)}, safetensors=True))


def test_a_sigkilled_writer_leaves_no_stuck_lock(held_writer):
    p, directory, _ = held_writer
    os.kill(p.pid, signal.SIGKILL)
    p.join(HANG_GUARD_S)
    assert p.exitcode == -signal.SIGKILL
    assert os.path.exists(os.path.join(directory, lock_file_name()))   # the file stays; the lock does not
    assert not validate_distributed(directory).ok
    save_distributed({"w": torch.full((4,), 2.0), "step": 2}, directory, 0, 1, None)
    assert validate_distributed(directory).ok
    assert torch.equal(load_consolidated(directory)["w"], torch.full((4,), 2.0))
    assert not os.path.exists(os.path.join(directory, lock_file_name()))


def test_a_forked_child_does_not_hold_the_lock(ctx, tmp_path):
    child_pid = ctx.Value("i", 0)
    p = ctx.Process(target=_hold_lock_and_fork, args=(str(tmp_path), child_pid))
    p.start()
    try:
        for _ in range(HANG_GUARD_S * 100):
            if child_pid.value:
                break
            p.join(0.01)
        assert child_pid.value, "the lock holder never forked"
        with pytest.raises(CheckpointBusyError):                   # the parent holds it ...
            _in_thread(lambda: local_writer_lock(str(tmp_path)).__enter__())
        os.kill(p.pid, signal.SIGKILL)
        p.join(HANG_GUARD_S)
        os.kill(child_pid.value, 0)                                 # ... its child is still alive ...
        with local_writer_lock(str(tmp_path), holder="after the parent died"):
            pass                                                    # ... and holds nothing
    finally:
        if child_pid.value:
            os.kill(child_pid.value, signal.SIGKILL)
        if p.is_alive():
            p.kill()


def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    store = LocalStorage()
    with store.writer_lock(str(tmp_path), holder="the first writer"):
        with pytest.raises(CheckpointBusyError, match=f"pid {os.getpid()}.*the first writer"):
            save_distributed({"w": torch.zeros(2)}, tmp_path, 0, 1, None)
        with pytest.raises(CheckpointBusyError):
            store.writer_lock(str(tmp_path)).__enter__()
        with store.writer_lock(str(tmp_path), slot=1):              # another slot: another rank's lock
            pass
    assert os.listdir(tmp_path) == []


def test_the_lock_file_records_its_holder(tmp_path):
    with local_writer_lock(str(tmp_path), holder="me"):
        record = json.loads((tmp_path / lock_file_name()).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and record["holder"] == "me"
    assert "since" in record


def test_a_busy_directory_fails_every_rank_of_a_group_save_before_anything_is_touched(tmp_path):
    from shardkit.comm import Group

    save_distributed({"w": torch.ones(2)}, tmp_path, 0, 1, None)
    before = sorted(os.listdir(tmp_path))
    groups = Group.local(2)
    errors = {}

    def rank_main(g):
        try:
            save_distributed({"w": torch.zeros(2)}, tmp_path, g.rank, 2, None, group=g)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[g.rank] = e

    try:
        with LocalStorage().writer_lock(str(tmp_path), slot=1, holder="someone else's rank 1"):
            threads = [threading.Thread(target=rank_main, args=(g,)) for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join(HANG_GUARD_S)
    finally:
        for g in groups:
            g.close()
    assert set(errors) == {0, 1} and all(isinstance(e, CheckpointBusyError) for e in errors.values())
    assert "someone else's rank 1" in str(errors[0]) and "nothing was written" in str(errors[0])
    assert sorted(os.listdir(tmp_path)) == before
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.ones(2))


def test_lock_names_are_neither_temp_nor_checkpoint_files():
    assert is_lock_name(lock_file_name()) and is_lock_name(lock_file_name(7))
    for name in ("metadata.json", "rank_0.safetensors", "rank_0.json", "model.safetensors", ".x.tmp"):
        assert not is_lock_name(name)
    assert not is_temp_name(lock_file_name())


def test_a_stale_lock_file_is_ignored_by_validation_listings_and_clean_up(tmp_path):
    from shardkit.hf import (
        find_latest_checkpoint, get_checkpoint_metadata, maybe_delete_oldest_checkpoint, next_checkpoint_path,
        save_checkpoint, validate_checkpoint,
    )
    from shardkit.hf.directory import list_checkpoints

    paths = [next_checkpoint_path(str(tmp_path), i) for i in (1, 2, 3)]
    save_checkpoint(paths[0], {"w": torch.ones(2)}, safetensors=True)
    save_distributed({"w": torch.ones(2)}, paths[1], 0, 1, None)
    os.makedirs(paths[2])
    for p in paths:                                     # as a SIGKILLed writer leaves it
        (open(os.path.join(p, lock_file_name()), "w")).write("{}")
    assert get_checkpoint_metadata(paths[2]) is None    # a lock file alone is not a checkpoint
    assert validate_checkpoint(paths[0]) and validate_checkpoint(paths[1]) and not validate_checkpoint(paths[2])
    assert validate_distributed(paths[1]).ok
    assert list_checkpoints(str(tmp_path)) == paths[:2]
    assert find_latest_checkpoint(str(tmp_path)) == paths[1]
    maybe_delete_oldest_checkpoint(str(tmp_path), 1)
    assert not os.path.exists(paths[0]) and list_checkpoints(str(tmp_path)) == paths[1:2]


def test_object_stores_hold_no_lock_and_still_save(tmp_path):
    store, root = storage_for("memory://shardkit-writer-lock-test/ck")
    with store.writer_lock(root):
        with store.writer_lock(root):                   # documented: nothing is held on fsspec stores
            pass
    save_distributed({"w": torch.ones(2)}, "memory://shardkit-writer-lock-test/ck", 0, 1, None)
    assert validate_distributed("memory://shardkit-writer-lock-test/ck").ok


def test_a_file_system_without_flock_saves_unlocked_with_a_warning(tmp_path, monkeypatch):
    import errno

    import shardkit.storage.backends.lock as lock

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    with pytest.warns(RuntimeWarning, match="refuses flock.*holds no writer lock"):
        save_distributed({"w": torch.ones(2)}, tmp_path, 0, 1, None)
    assert validate_distributed(tmp_path).ok and os.listdir(tmp_path).count(lock_file_name()) == 0


@pytest.mark.parametrize("code, kept", [("ENOLCK", True), ("EOPNOTSUPP", False)])
def test_a_file_system_refusing_flock_saves_unlocked_and_keeps_a_lock_file_it_may_share(tmp_path, monkeypatch, code, kept):
    # ENOLCK may pass (out of lock records, NFS lockd unreachable): another writer may hold that file's lock
    import errno

    import shardkit.storage.backends.lock as lock

    def refuse(fd, how):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(lock.fcntl, "flock", refuse)
    with pytest.warns(RuntimeWarning, match="refuses flock"):
        with local_writer_lock(str(tmp_path)):
            pass
    assert (tmp_path / lock_file_name()).exists() is kept


def test_a_failure_after_the_lock_is_taken_releases_it(tmp_path, monkeypatch):
    from fds import open_on

    import shardkit.storage.backends.lock as lock

    monkeypatch.setattr(lock, "_still_named", lambda fd, path: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with pytest.raises(OSError):
        with local_writer_lock(str(tmp_path)):
            pass
    assert open_on(tmp_path / lock_file_name()) == 0
    monkeypatch.undo()
    with local_writer_lock(str(tmp_path)):  # not left locked
        pass

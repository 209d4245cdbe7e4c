"""A full disk, a read-only file system or a refused permission while saving gives a CheckpointIOError.

The error is also an ``OSError`` with the original ``errno``; its message names
the file, says what happened and what to do. Whatever was saved before stays
loadable and no temporary file is left behind. Failures are injected by
monkeypatching the system calls the writers use, and, where this process may
mount (root in a VM), on a real 1 MiB tmpfs (ENOSPC) and a read-only remount
of it (EROFS).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess

import pytest
import torch

from shardkit import hf
from shardkit.checkpoint import AsyncCheckpointer, load_distributed, save_distributed, validate_distributed
from shardkit.errors import AsyncCheckpointError, CheckpointError, CheckpointIOError
from shardkit.storage import LocalStorage, write_safetensors
import shardkit.storage.backends.atomic as atomic

FAILURES = {
    errno.ENOSPC: "disk is full",
    errno.EDQUOT: "quota",
    errno.EROFS: "read-only",
    errno.EACCES: "permission",
    errno.EPERM: "not permitted",
}


def _state(value: float, numel: int = 64 * 1024) -> dict:
    return {"w": torch.full((numel,), value), "step": int(value)}


def _assert_typed(e: BaseException, code: int, path_part: str) -> None:
    assert isinstance(e, CheckpointIOError) and isinstance(e, OSError) and isinstance(e, CheckpointError)
    assert e.errno == code and e.strerror == os.strerror(code)
    assert path_part in str(e) and FAILURES[code] in str(e)
    assert "untouched" in str(e) and "save again" in str(e)


def _no_temp_files(directory) -> bool:
    return not [n for dirpath, _, names in os.walk(directory) for n in names if n.endswith(".tmp")]


def _failing(code: int):
    def fail(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("code", sorted(FAILURES))
@pytest.mark.parametrize("sink", ["direct", "buffered", "inline"])
def test_a_failing_data_write_raises_checkpoint_io_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch,
                                                                                      code, sink):
    from shardkit import knobs

    monkeypatch.setattr(knobs, "DIRECT_IO", sink == "direct")
    # This small file takes the path under test; "inline": written by the calling thread.
    monkeypatch.setattr(knobs, "SMALL_FILE_BYTES", 1 << 30 if sink == "inline" else 0)
    save_distributed(_state(1.0), str(tmp_path / "step-1"), 0, 1, None)
    monkeypatch.setattr(os, "pwrite", _failing(code))
    with pytest.raises(CheckpointIOError) as info:
        save_distributed(_state(2.0), str(tmp_path / "step-2"), 0, 1, None)
    monkeypatch.undo()
    _assert_typed(info.value, code, "rank_0.safetensors")
    assert isinstance(info.value.__cause__, OSError)
    assert load_distributed(str(tmp_path / "step-1"), 0, 1)["step"] == 1
    assert not validate_distributed(str(tmp_path / "step-2")).ok
    assert _no_temp_files(tmp_path)


def test_except_oserror_still_catches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", _failing(errno.ENOSPC))
    try:
        save_distributed(_state(1.0), str(tmp_path / "ck"), 0, 1, None)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        pytest.fail("no error")


def test_a_refused_temporary_file_and_a_refused_directory_are_typed(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "open", _failing(errno.EACCES), raising=False)
    with pytest.raises(CheckpointIOError) as info:
        save_distributed(_state(1.0), str(tmp_path / "ck"), 0, 1, None)
    _assert_typed(info.value, errno.EACCES, str(tmp_path / "ck"))
    monkeypatch.undo()
    monkeypatch.setattr(os, "makedirs", _failing(errno.EROFS))
    with pytest.raises(CheckpointIOError) as info:
        save_distributed(_state(1.0), str(tmp_path / "other"), 0, 1, None)
    _assert_typed(info.value, errno.EROFS, str(tmp_path / "other"))


def test_a_failing_fsync_is_typed(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", _failing(errno.EDQUOT))
    with pytest.raises(CheckpointIOError) as info:
        write_safetensors(LocalStorage(), str(tmp_path / "f.safetensors"), [("w", torch.ones(10))])
    _assert_typed(info.value, errno.EDQUOT, "f.safetensors")
    assert not (tmp_path / "f.safetensors").exists() and _no_temp_files(tmp_path)


def test_an_oserror_about_another_file_keeps_its_own_type(tmp_path):
    from shardkit.storage import LazyTensor

    def load():
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere/else.bin")

    with pytest.raises(PermissionError) as info:
        write_safetensors(LocalStorage(), str(tmp_path / "f.safetensors"), [("w", LazyTensor(torch.float32, (4,), load))])
    assert not isinstance(info.value, CheckpointIOError)


def test_async_checkpointer_reports_a_full_disk_as_both_error_types(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", _failing(errno.ENOSPC))
    with AsyncCheckpointer(str(tmp_path / "ck"), 0, 1, None) as ckpt:
        future = ckpt.save_async(_state(1.0))
        with pytest.raises(AsyncCheckpointError) as info:
            future.wait()
        assert isinstance(info.value, CheckpointIOError) and info.value.errno == errno.ENOSPC
        assert isinstance(info.value.__cause__, CheckpointIOError)
        monkeypatch.undo()
        ckpt.save_async(_state(2.0)).wait()  # the checkpointer goes on
    assert load_distributed(str(tmp_path / "ck"), 0, 1)["step"] == 2


class _FullDiskFile(io.FileIO):
    """A file that takes ``room`` bytes, then fails like a full disk."""

    room = 1000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.mark.parametrize("safetensors", [False, True])
def test_hf_save_on_a_full_disk_is_typed_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, safetensors):
    model = torch.nn.Linear(64, 64)
    old = str(tmp_path / "checkpoint-1")
    hf.save_checkpoint(old, model, safetensors=safetensors)
    monkeypatch.setattr(atomic, "open", lambda path, mode, buffering: _FullDiskFile(path, "xb"), raising=False)
    monkeypatch.setattr(os, "pwrite", _failing(errno.ENOSPC))
    with pytest.raises(CheckpointIOError) as info:
        hf.save_checkpoint(str(tmp_path / "checkpoint-2"), model, safetensors=safetensors)
    monkeypatch.undo()
    _assert_typed(info.value, errno.ENOSPC, "checkpoint-2")
    if not safetensors:  # torch.save said only "inline_container.cc ... file write failed"
        assert isinstance(info.value.__cause__, RuntimeError)
    assert _no_temp_files(tmp_path)
    fresh = torch.nn.Linear(64, 64)
    hf.load_checkpoint(old, fresh)
    assert torch.equal(fresh.weight, model.weight)


# --- a real small tmpfs --------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(path, size: str):
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.mark.parametrize("safetensors", [False, True])
def test_a_real_full_tmpfs_gives_enospc_and_keeps_the_previous_checkpoint(tmp_path, safetensors):
    with _tmpfs(tmp_path / "mnt", "1m") as mnt:
        save_distributed(_state(1.0, numel=16 * 1024), str(mnt / "step-1"), 0, 1, None)  # 64 KiB: fits
        with pytest.raises(CheckpointIOError) as info:
            save_distributed(_state(2.0, numel=512 * 1024), str(mnt / "step-2"), 0, 1, None)  # 2 MiB
        _assert_typed(info.value, errno.ENOSPC, str(mnt / "step-2"))
        small = torch.nn.Linear(8, 8)
        hf.save_checkpoint(str(mnt / "hf-1"), small, safetensors=safetensors)
        with pytest.raises(CheckpointIOError) as info:
            hf.save_checkpoint(str(mnt / "hf-2"), torch.nn.Linear(512, 512), safetensors=safetensors)
        _assert_typed(info.value, errno.ENOSPC, str(mnt / "hf-2"))
        assert _no_temp_files(mnt)
        assert torch.equal(load_distributed(str(mnt / "step-1"), 0, 1)["w"], torch.full((16 * 1024,), 1.0))
        fresh = torch.nn.Linear(8, 8)
        hf.load_checkpoint(str(mnt / "hf-1"), fresh)
        assert torch.equal(fresh.weight, small.weight)


def test_a_real_read_only_remount_gives_erofs_and_keeps_the_previous_checkpoint(tmp_path):
    with _tmpfs(tmp_path / "mnt", "4m") as mnt:
        save_distributed(_state(1.0), str(mnt / "step-1"), 0, 1, None)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, timeout=30)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remount.stderr!r}")
        with pytest.raises(CheckpointIOError) as info:
            save_distributed(_state(2.0), str(mnt / "step-2"), 0, 1, None)
        _assert_typed(info.value, errno.EROFS, str(mnt / "step-2"))
        with pytest.raises(CheckpointIOError) as info:  # overwriting in place: nothing is withdrawn
            save_distributed(_state(3.0), str(mnt / "step-1"), 0, 1, None)
        _assert_typed(info.value, errno.EROFS, str(mnt / "step-1"))
        assert load_distributed(str(mnt / "step-1"), 0, 1)["step"] == 1

"""An fsspec client's ``OSError`` becomes ``CheckpointIOError``; a missing file keeps its meaning (``memory://``, no server).

s3fs turns S3's ``AccessDenied`` into a plain ``PermissionError``; here a
``memory://`` store's client raises one the same way, so the translation is
checked without a server that can deny access (the session's SeaweedFS
accepts any credentials).
"""

from __future__ import annotations

import errno
import subprocess
import sys
import uuid

import pytest
import torch

from shardkit.checkpoint import load, save, validate_distributed
from shardkit.errors import CheckpointIOError, MissingShardError
from shardkit.storage import storage_for


def _url() -> str:
    return f"memory://shardkit-store-errors-{uuid.uuid4().hex}/ck"


def _deny(monkeypatch, fs, *methods: str) -> None:
    def refuse(*args, **kwargs):
        raise PermissionError("Access Denied")   # what s3fs raises for S3's AccessDenied
    for name in methods:
        monkeypatch.setattr(fs, name, refuse)


def test_a_refused_read_is_a_checkpoint_io_error_with_eacces(monkeypatch):
    url = _url()
    save({"w": torch.ones(3)}, url)
    store, _ = storage_for(url)
    _deny(monkeypatch, store.fs, "cat_file", "cat_ranges", "open")
    with pytest.raises(CheckpointIOError) as caught:
        load({"w": torch.zeros(3)}, url)
    e = caught.value
    assert e.errno == errno.EACCES and isinstance(e.__cause__, PermissionError)
    assert url in str(e) and "refused permission" in str(e)


def test_a_refused_write_is_a_checkpoint_io_error(monkeypatch):
    url = _url()
    store, _ = storage_for(url)
    _deny(monkeypatch, store.fs, "open")
    with pytest.raises(CheckpointIOError) as caught:
        save({"w": torch.ones(3)}, url)
    assert caught.value.errno == errno.EACCES and url in str(caught.value)


def test_validate_reports_a_refused_read_as_a_problem(monkeypatch):
    url = _url()
    save({"w": torch.ones(3)}, url)
    store, _ = storage_for(url)
    _deny(monkeypatch, store.fs, "cat_file", "cat_ranges", "open")
    report = validate_distributed(url)
    assert not report.ok and "refused permission" in report.problems[0]


def test_a_missing_file_is_still_missing_shard_error_and_shardkit_errors_pass_through():
    store, path = storage_for(_url() + "/metadata.json")
    with pytest.raises(MissingShardError):
        store.open_reader(path)
    with pytest.raises(FileNotFoundError) as caught:
        store.size_bytes(path)
    assert not isinstance(caught.value, CheckpointIOError)


def test_translation_works_without_botocore_or_aiohttp():
    # A machine without s3fs: shardkit still imports, and a client's OSError is still typed.
    code = ("import sys; sys.modules.update({m: None for m in ('botocore', 'botocore.exceptions', 'aiohttp', 's3fs')})\n"
            "from shardkit.storage import storage_for\n"
            "from shardkit.errors import CheckpointIOError\n"
            "store, path = storage_for('memory://no-client-libs/x')\n"
            "def refuse(*a, **k): raise PermissionError('denied')\n"
            "store.fs.size = refuse\n"
            "try: store.size_bytes(path)\n"
            "except CheckpointIOError as e: print('typed', e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"typed {errno.EACCES}"

"""storage.fast_io.direct_io: O_DIRECT writes through bounce buffers give the same bytes, or fall back.

Small blocks (two pages) and a queue of two make every boundary case cheap:
pieces that straddle blocks, an exact multiple of the block, an empty file,
and a tail that needs padding then truncation.
"""

from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from shardkit import knobs
from shardkit.storage import LocalStorage, write_safetensors
import shardkit.storage.fast_io.direct_io as direct_io
from shardkit.storage.fast_io.direct_io import ALIGN_BYTES, open_direct_sink

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(knobs, "DIRECT_IO_BLOCK_BYTES", 2 * ALIGN_BYTES)
    monkeypatch.setattr(knobs, "DIRECT_IO_QUEUE_DEPTH", 2)
    monkeypatch.setattr(knobs, "SMALL_FILE_BYTES", 0)  # small files too take the path under test


def _write_pieces(path, pieces: list[bytes]) -> bool:
    """Write ``pieces`` through a direct sink if the file system takes one; return whether it did."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sink = open_direct_sink(fd)
        if sink is None:
            return False
        for piece in pieces:
            sink.write(memoryview(piece))
        sink.close()
        return True
    finally:
        os.close(fd)


def _direct_or_skip(tmp_path):
    if not _write_pieces(tmp_path / "probe", [b"x"]):
        pytest.skip("this file system refuses O_DIRECT")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5 * ALIGN_BYTES), max_size=8))
def test_any_split_of_any_length_lands_byte_for_byte(tmp_path_factory, sizes):
    tmp = tmp_path_factory.mktemp("dio")
    _direct_or_skip(tmp)
    pieces = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    assert _write_pieces(tmp / "f", pieces)
    assert (tmp / "f").read_bytes() == b"".join(pieces)


@pytest.mark.parametrize("nbytes", [0, 1, ALIGN_BYTES, 2 * ALIGN_BYTES, 2 * ALIGN_BYTES + 1, 7 * ALIGN_BYTES - 3])
def test_boundaries_and_the_padded_tail_are_truncated_away(tmp_path, nbytes):
    _direct_or_skip(tmp_path)
    data = os.urandom(nbytes)
    assert _write_pieces(tmp_path / "f", [data])
    assert (tmp_path / "f").read_bytes() == data


def _state():
    return {"a": torch.randn(1000), "b": torch.arange(5000, dtype=torch.int64), "c": torch.tensor(3.5),
            "d": torch.empty(0, 4), "e": torch.ones(3, dtype=torch.bfloat16)}


def test_a_safetensors_file_is_the_same_with_and_without_direct_io(tmp_path, monkeypatch):
    _direct_or_skip(tmp_path)
    state = _state()
    store = LocalStorage()
    direct = write_safetensors(store, str(tmp_path / "direct.safetensors"), list(state.items()))
    monkeypatch.setattr(knobs, "DIRECT_IO", False)
    buffered = write_safetensors(store, str(tmp_path / "buffered.safetensors"), list(state.items()))
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    assert direct == buffered  # same block checksums
    loaded = load_file(tmp_path / "direct.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_file_system_that_refuses_the_flag_gets_buffered_writes(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def refuse(fd, cmd, *arg):
        if cmd == fcntl.F_SETFL:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, *arg)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse)
    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert open_direct_sink(fd) is None
    finally:
        os.close(fd)
    state = _state()
    write_safetensors(LocalStorage(), str(tmp_path / "x.safetensors"), list(state.items()))
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_direct_write_refused_with_einval_is_written_again_buffered(tmp_path, monkeypatch):
    _direct_or_skip(tmp_path)
    real = os.pwrite
    refused = []

    def picky(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", picky)
    data = os.urandom(5 * ALIGN_BYTES + 17)
    assert _write_pieces(tmp_path / "f", [data[:100], data[100:]])
    monkeypatch.undo()
    assert refused  # the first direct write was refused ...
    assert (tmp_path / "f").read_bytes() == data  # ... and nothing was lost


def test_a_failed_write_publishes_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    _direct_or_skip(tmp_path)
    store, path = LocalStorage(), str(tmp_path / "x.safetensors")
    write_safetensors(store, path, [("w", torch.zeros(10))])
    before = (tmp_path / "x.safetensors").read_bytes()

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        write_safetensors(store, path, [("w", torch.ones(100_000))])
    monkeypatch.undo()
    assert (tmp_path / "x.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe", "x.safetensors"]  # no temporary left

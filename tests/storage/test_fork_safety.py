"""Saves in forked processes never share write buffers; checksums describe the bytes written.

A process that saved once has a warm pool of direct-I/O bounce buffers. Its
forked children (``os.fork``, multiprocessing's fork start method, forked
Gloo ranks) must each write through their own memory: with shared buffers,
concurrent saves committed each other's bytes and every save still
"succeeded". Each test here saves in the parent first (the pool is warm),
then saves different values concurrently in several children and loads
every result with the default (unverified) load.

The corruption tests change bytes between the copy into a bounce buffer and
the disk: the save must fail, or the recorded checksums must expose it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import tempfile

import pytest
import torch

from shardkit import knobs
from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_distributed, save_distributed, validate_distributed
from shardkit.errors import ChecksumError
import shardkit.storage.fast_io.direct_io as direct_io
from shardkit.storage.fast_io.direct_io import ALIGN_BYTES

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(os, "O_DIRECT"),
                                reason="needs fork and O_DIRECT (Linux)")

CHILDREN = 4
ROUNDS = 3
NUMEL = 256 * 1024  # 1 MiB of float32 per tensor: many small bounce buffers per file


@pytest.fixture(autouse=True)
def small_buffers_one_thread(monkeypatch):
    # Small blocks: many buffer hand-offs per file, so shared buffers would collide every time.
    monkeypatch.setattr(knobs, "DIRECT_IO_BLOCK_BYTES", 16 * ALIGN_BYTES)
    monkeypatch.setattr(knobs, "DIRECT_IO_QUEUE_DEPTH", 2)
    monkeypatch.setattr(knobs, "SMALL_FILE_BYTES", 0)  # small files too take the path under test
    # A child that inherits torch's OpenMP team from its parent hangs in its first parallel op.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _direct_or_skip(directory: str) -> None:
    fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if direct_io.open_direct_sink(fd) is None:
            pytest.skip("this file system refuses O_DIRECT")
    finally:
        os.close(fd)


def _value(child: int, round_: int) -> float:
    return float(100 * (child + 1) + round_)


def _state(value: float) -> dict:
    return {"w": torch.full((NUMEL,), value), "b": torch.full((NUMEL // 2,), -value, dtype=torch.float64),
            "step": int(value)}


def _save_rounds_in_child(root: str, child: int, go_r: int) -> None:
    os.read(go_r, 1)  # every child starts together, so their saves overlap
    for round_ in range(ROUNDS):
        save_distributed(_state(_value(child, round_)), os.path.join(root, f"c{child}-r{round_}"), 0, 1, None)


def _fork_children(root: str) -> list[int]:
    go_r, go_w = os.pipe()
    pids = []
    for child in range(CHILDREN):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                _save_rounds_in_child(root, child, go_r)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.write(go_w, b"x" * CHILDREN)
    os.close(go_r), os.close(go_w)
    return pids


def _assert_state(directory: str, value: float) -> None:
    loaded = load_distributed(directory, 0, 1)  # the default load: no checksum verification
    assert torch.equal(loaded["w"], torch.full((NUMEL,), value)), f"{directory}: foreign bytes in w"
    assert torch.equal(loaded["b"], torch.full((NUMEL // 2,), -value, dtype=torch.float64))
    assert loaded["step"] == int(value)
    assert validate_distributed(directory).ok


def test_forked_children_saving_at_once_each_commit_their_own_bytes(tmp_path):
    _direct_or_skip(str(tmp_path))
    save_distributed(_state(1.0), str(tmp_path / "parent"), 0, 1, None)  # warms the parent's pool
    assert direct_io._POOL._free, "the parent's pool should hold buffers now"
    pids = _fork_children(str(tmp_path))
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0] * CHILDREN
    for child in range(CHILDREN):
        for round_ in range(ROUNDS):
            _assert_state(str(tmp_path / f"c{child}-r{round_}"), _value(child, round_))
    _assert_state(str(tmp_path / "parent"), 1.0)


def test_a_forked_child_starts_with_its_own_empty_pool(tmp_path):
    _direct_or_skip(str(tmp_path))
    save_distributed(_state(1.0), str(tmp_path / "parent"), 0, 1, None)
    parent_buffers = {id(b.map) for b in direct_io._POOL._free}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = not direct_io._POOL._free and not ({id(b.map) for b in direct_io._POOL._free} & parent_buffers)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)


# --- three forked Gloo ranks, group saves ------------------------------------

WORLD = 3
SPEC = ShardMetadata(WORLD, {"w": TensorShardSpec((WORLD * NUMEL,), 0, (NUMEL,) * WORLD)})


def _rank_value(round_: int, rank: int) -> float:
    return float(10 * (round_ + 1) + rank)


def _gloo_rank(rank: int, root: str, store_path: str, errors) -> None:  # pragma: no cover - in a child
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
        for round_ in range(ROUNDS):
            state = {"w": torch.full((NUMEL,), _rank_value(round_, rank)), "round": round_}
            save_distributed(state, os.path.join(root, f"group-r{round_}"), rank, WORLD, SPEC,
                             group=dist.group.WORLD)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_group_saves_over_forked_gloo_ranks_commit_each_ranks_own_bytes(tmp_path):
    _direct_or_skip(str(tmp_path))
    save_distributed(_state(1.0), str(tmp_path / "parent"), 0, 1, None)  # warms the parent's pool
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    store = tempfile.mktemp(dir=str(tmp_path), prefix="store-")
    procs = [ctx.Process(target=_gloo_rank, args=(r, str(tmp_path), store, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():  # a hang guard, not a timing assertion
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures and [p.exitcode for p in procs] == [0] * WORLD, failures
    for round_ in range(ROUNDS):
        directory = str(tmp_path / f"group-r{round_}")
        expected = torch.cat([torch.full((NUMEL,), _rank_value(round_, r)) for r in range(WORLD)])
        loaded = load_distributed(directory, 0, 1)
        assert torch.equal(loaded["w"], expected), f"{directory}: a rank's file holds another rank's bytes"
        assert loaded["round"] == round_
        assert validate_distributed(directory).ok


# --- corruption between the copy and the disk -------------------------------

def test_a_bounce_buffer_changed_after_the_copy_fails_the_save_and_publishes_nothing(tmp_path, monkeypatch):
    _direct_or_skip(str(tmp_path))
    directory = str(tmp_path / "ck")
    save_distributed(_state(1.0), directory, 0, 1, None)
    before = (tmp_path / "ck" / "rank_0.safetensors").read_bytes()
    real_pwrite = os.pwrite

    def corrupt_then_write(fd, data, offset):
        # The bounce buffer changes after the copy (as another process writing through a shared buffer
        # once changed it): the bytes written are not the tensors' bytes.
        if len(data) > 64 and not memoryview(data).readonly:  # a bounce buffer, not a metadata file's bytes
            ctypes.c_ubyte.from_address(ctypes.addressof(ctypes.c_char.from_buffer(data)) + len(data) // 2).value ^= 0xFF
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", corrupt_then_write)
    with pytest.raises(ChecksumError, match="differ from the tensors' bytes"):
        save_distributed(_state(2.0), directory, 0, 1, None)
    monkeypatch.undo()
    # The data file was never replaced, and no temporary file is left behind.
    assert (tmp_path / "ck" / "rank_0.safetensors").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")) == []


def test_bytes_changed_on_their_way_to_disk_do_not_get_matching_checksums(tmp_path, monkeypatch):
    import mmap

    _direct_or_skip(str(tmp_path))
    directory = str(tmp_path / "ck")
    real_pwrite = os.pwrite
    corrupted = []

    def pwrite_a_corrupted_copy(fd, data, offset):
        if corrupted or len(data) < 2 * ALIGN_BYTES:
            return real_pwrite(fd, data, offset)
        copy = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # aligned, for O_DIRECT
        copy[:] = bytes(data)
        copy[len(data) // 2] ^= 0xFF
        corrupted.append(offset)
        with memoryview(copy) as view:
            return real_pwrite(fd, view, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", pwrite_a_corrupted_copy)
    save_distributed(_state(3.0), directory, 0, 1, None)
    monkeypatch.undo()
    assert corrupted
    report = validate_distributed(directory)
    assert not report.ok and any("checksum" in p for p in report.problems), report.problems
    with pytest.raises(ChecksumError):
        load_distributed(directory, 0, 1, verify=True)

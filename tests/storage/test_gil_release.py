"""A background save holds the GIL for almost nothing, and the C writer behind it records the right bytes.

The GIL test runs a probe thread that releases the GIL every few
microseconds (``zlib.crc32`` of 16 KiB, as a training step's torch ops do)
and counts how often it had to block to get the GIL back (its voluntary
context switches: nothing else in its loop blocks) while background saves
are in flight. Every hand-off to a save's background thread that stalls
training shows up there, and a count is not a time. A save's own system
calls and plan cost a few dozen hand-offs whatever its size; what must not
be there is a cost per byte: the Python write loop this replaced blocked
the probe 43-95 times per 64 MiB save and 145-211 times per 512 MiB one
(2-core VM); the C writer 3-32 and 7-18.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib

import pytest
import torch

from shardkit import knobs
from shardkit.checkpoint import load_distributed
from shardkit.checkpoint.api import async_save
from shardkit.storage import BlockHasher
from shardkit.storage.fast_io.direct_io import ALIGN_BYTES, DirectSink, open_direct_sink

resource = pytest.importorskip("resource")

pytestmark = pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD") or not hasattr(os, "O_DIRECT"),
                                reason="needs per-thread rusage and O_DIRECT (Linux)")

SAVES = 3
SMALL_MIB, LARGE_MIB = 64, 512
#: How many more times (median per save) the probe may block during a LARGE_MIB save than a SMALL_MIB one.
SLACK_BLOCKS = 25


def _direct_sink_or_skip(path) -> tuple[DirectSink, int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sink = open_direct_sink(fd, BlockHasher(knobs.CHECKSUM_BLOCK_BYTES))
    if sink is None:
        os.close(fd)
        pytest.skip("this file system (or build) takes no O_DIRECT writes")
    return sink, fd


class _Probe:
    """A thread that releases the GIL every few microseconds; ``blocked()`` counts how often it waited for it."""

    def __init__(self):
        self._stop = False
        self._asked: list[int] = []
        self._answer = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        data = bytes(16 << 10)
        while not self._stop:
            zlib.crc32(data)  # releases the GIL
            if self._asked:
                self._asked.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)
                self._asked.pop(0)
                self._answer.set()

    def blocked(self) -> int:
        """The probe's voluntary context switches so far (read by the probe itself)."""
        self._answer.clear()
        self._asked.append(-1)
        while not self._answer.wait(0.01):
            pass
        return self._asked.pop()

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def _blocks_per_save(tmp_path, mib: int) -> int:
    """The median over SAVES background saves of a state of ``mib`` MiB (8 tensors) of how often the probe
    blocked for the GIL while one was in flight."""
    state = {f"t{i}": torch.full(((mib << 20) // 32,), float(i)) for i in range(8)}
    async_save(state, str(tmp_path / f"warm-{mib}")).wait()  # staging buffers and the bounce pool are warm
    probe = _Probe()
    try:
        blocks = []
        for n in range(SAVES):
            future = async_save(state, str(tmp_path / f"s{mib}-{n}"))
            before = probe.blocked()
            future.wait()
            blocks.append(probe.blocked() - before)
    finally:
        probe.stop()
    loaded = load_distributed(str(tmp_path / f"s{mib}-{SAVES - 1}"), 0, 1, verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    return sorted(blocks)[len(blocks) // 2]


def test_a_background_save_stalls_a_gil_releasing_thread_per_save_not_per_byte(tmp_path):
    _check_direct(tmp_path)
    interval = sys.getswitchinterval()
    # A thread that wants the GIL takes it from running Python code only after this interval: the
    # save's own Python work (its plan, its metadata) then costs the probe about one block per burst,
    # not one per 5 ms of it, whatever the machine's load. Hand-offs at the probe's GIL releases (a
    # background thread back from a system call or a C call) are unaffected.
    sys.setswitchinterval(0.05)
    try:
        small, large = _blocks_per_save(tmp_path, SMALL_MIB), _blocks_per_save(tmp_path, LARGE_MIB)
    finally:
        sys.setswitchinterval(interval)
    # The save's own system calls and plan cost the same hand-offs at any size; 8x the bytes must not add
    # more than slack (the Python write loop added 100-160 at these sizes, 2-core VM).
    assert large <= small + SLACK_BLOCKS, f"the probe blocked {small} times per {SMALL_MIB} MiB save, {large} per {LARGE_MIB} MiB"


def _check_direct(tmp_path) -> None:
    sink, fd = _direct_sink_or_skip(str(tmp_path / "probe"))
    sink.close()
    os.close(fd)


@pytest.mark.parametrize("block_bytes", [1000, ALIGN_BYTES, 3 * ALIGN_BYTES + 5, 1 << 20])
def test_the_writers_records_are_those_of_the_bytes_in_any_split(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(knobs, "DIRECT_IO_BLOCK_BYTES", 2 * ALIGN_BYTES)
    monkeypatch.setattr(knobs, "DIRECT_IO_QUEUE_DEPTH", 3)
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", block_bytes)
    data = os.urandom(11 * ALIGN_BYTES + 123)
    cuts = [0, 1, 100, ALIGN_BYTES, 5 * ALIGN_BYTES + 7, 5 * ALIGN_BYTES + 7, len(data)]
    pieces = [memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])]
    sink, fd = _direct_sink_or_skip(str(tmp_path / "f"))
    try:
        sink.write_many(pieces[:3])
        sink.write(pieces[3])
        sink.write_many(pieces[4:])
        sink.close()
    finally:
        os.close(fd)
    expected = BlockHasher(block_bytes)
    expected.update(data)
    want = expected.finish()
    assert (tmp_path / "f").read_bytes() == data
    assert sink.source_record() == want
    assert sink.hasher.finish() == want


def test_a_forked_child_can_drop_a_writer_whose_threads_stayed_in_the_parent(tmp_path):
    sink, fd = _direct_sink_or_skip(str(tmp_path / "f"))
    try:
        sink.write(memoryview(os.urandom(3 * ALIGN_BYTES)))
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                del sink  # its threads are not in this process: nothing to join
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        sink.close()
    finally:
        os.close(fd)
    assert (tmp_path / "f").stat().st_size == 3 * ALIGN_BYTES

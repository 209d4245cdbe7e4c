"""The gil bench's floor row (a helper process that writes the bytes it holds, fsync'd, when told a path)
and its control row (nothing in flight for a fixed time)."""

import time

from shardkit.bench.checkpoint_suites import gil_bench


def test_the_floor_writer_writes_every_byte_and_says_when_it_is_done(tmp_path):
    saver = gil_bench.floor_saver(3 << 20)
    try:
        for i in range(2):
            path = str(tmp_path / f"floor-{i}")
            handle = saver.start(path)
            saver.finish(handle)
            assert saver.done(handle) is False   # answered once per save, nothing left to read
            with open(path, "rb") as f:
                assert f.read() == b"\x5a" * (3 << 20)
    finally:
        saver.close()


def test_the_control_is_done_after_its_time_and_not_before():
    saver = gil_bench.control_saver(0.2)
    began = time.perf_counter()
    handle = saver.start("unused")
    assert not saver.done(handle)
    while not saver.done(handle):
        time.sleep(0.01)
    assert time.perf_counter() - began >= 0.2
    saver.finish(handle)
    saver.close()

"""The gil bench's floor row: a helper process that writes the bytes it holds, fsync'd, when told a path."""

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

"""Background saves write through the page cache (``knobs.BACKGROUND_DIRECT_IO`` False), ``save`` with O_DIRECT."""

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit import knobs
from shardkit.storage.fast_io import sinks


@pytest.fixture
def sinks_opened(monkeypatch):
    opened = []
    real = sinks.local_sink

    def spy(fd, durable, checksum=False, size_bytes=None, inline=False, page_cache=False):
        opened.append(page_cache)
        return real(fd, durable, checksum, size_bytes, inline, page_cache)

    monkeypatch.setattr(sinks, "local_sink", spy)
    return opened


STATE = {"w": torch.arange(2 << 20, dtype=torch.float32)}   # 8 MiB: above SMALL_FILE_BYTES, a real sink


def test_async_save_asks_for_the_page_cache_and_save_does_not(tmp_path, sinks_opened):
    ck.async_save(STATE, str(tmp_path / "a")).wait()
    ck.save(STATE, str(tmp_path / "s"))
    assert sinks_opened == [True, False]
    out = {"w": torch.zeros(2 << 20)}
    ck.load(out, str(tmp_path / "a"))
    assert torch.equal(out["w"], STATE["w"])


def test_the_knob_gives_background_saves_o_direct_back(tmp_path, sinks_opened, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", True)
    ck.async_save(STATE, str(tmp_path / "a")).wait()
    assert sinks_opened == [False]


def test_the_manager_saves_through_the_page_cache_incremental_too(tmp_path, sinks_opened):
    state = {"w": STATE["w"].clone(), "v": torch.ones(2 << 20)}
    with ck.CheckpointManager(str(tmp_path), incremental=True) as manager:
        manager.save(0, state)
        manager.wait()
        state["v"].add_(1)
        manager.save(1, state)
        manager.wait()
    assert sinks_opened and all(sinks_opened)

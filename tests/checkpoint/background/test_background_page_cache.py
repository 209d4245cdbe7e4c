"""``knobs.BACKGROUND_DIRECT_IO``: background saves write with O_DIRECT (True, the default) or through the page cache."""

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


def test_async_save_asks_for_the_page_cache_only_when_the_knob_is_off(tmp_path, sinks_opened, monkeypatch):
    ck.async_save(STATE, str(tmp_path / "d")).wait()
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)
    ck.async_save(STATE, str(tmp_path / "a")).wait()
    ck.save(STATE, str(tmp_path / "s"))
    assert sinks_opened == [False, True, False]
    out = {"w": torch.zeros(2 << 20)}
    ck.load(out, str(tmp_path / "a"))
    assert torch.equal(out["w"], STATE["w"])


def test_a_page_cache_save_is_written_whole_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)
    ck.async_save(STATE, str(tmp_path / "a")).wait()
    assert ck.validate_distributed(str(tmp_path / "a")).ok


def test_the_manager_saves_through_the_page_cache_incremental_too(tmp_path, sinks_opened, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DIRECT_IO", False)
    state = {"w": STATE["w"].clone(), "v": torch.ones(2 << 20)}
    with ck.CheckpointManager(str(tmp_path), incremental=True) as manager:
        manager.save(0, state)
        manager.wait()
        state["v"].add_(1)
        manager.save(1, state)
        manager.wait()
    assert sinks_opened and all(sinks_opened)

"""Rank 0 assembles a manifest of O(ranks x tensors) objects with the cyclic collector paused.

In a process that has imported torch a full collection walks some 200,000
objects; building a large manifest set one off in the middle of every big
commit. ``storage.json_io.gc_paused`` pauses the collector for such a block
and restores whatever state the caller had.
"""

from __future__ import annotations

import gc

import pytest
import torch

from shardkit.checkpoint import load, save
import shardkit.checkpoint.saving.chunked_save as chunked_save
from shardkit.storage.json_io import gc_paused


@pytest.fixture
def collector_restored():
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_the_collector_is_paused_inside_and_restored_after_even_on_error(collector_restored):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled(collector_restored):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_commit_builds_the_manifest_with_the_collector_paused_and_saves_the_same_bytes(
        tmp_path, monkeypatch, collector_restored):
    gc.enable()
    seen = []
    real = chunked_save.manifest_to_json
    monkeypatch.setattr(chunked_save, "manifest_to_json", lambda m: seen.append(gc.isenabled()) or real(m))
    state = {"w": torch.arange(12.0).reshape(3, 4), "empty": torch.zeros(0), "step": 7}
    save(state, str(tmp_path))
    assert seen == [False]
    assert gc.isenabled()
    into = {"w": torch.zeros(3, 4), "empty": torch.zeros(0), "step": 0}
    load(into, str(tmp_path))
    assert torch.equal(into["w"], state["w"]) and into["step"] == 7

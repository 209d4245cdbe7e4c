"""``ManifestCache``: a parse is reused only for the very bytes it was made from, never stale."""

from __future__ import annotations

import shutil

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit.checkpoint import CheckpointManager
from shardkit.checkpoint.format import manifest as manifest_module
from shardkit.checkpoint.format.manifest import METADATA_FILE, read_manifest
from shardkit.checkpoint.format.manifest_cache import ManifestCache
from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError
from shardkit.storage import storage_for


@pytest.fixture
def parses(monkeypatch):
    """The sources ``parse_manifest`` parsed, in order."""
    seen = []
    real = manifest_module.parse_manifest

    def counting(source, data):
        seen.append(source)
        return real(source, data)

    monkeypatch.setattr(manifest_module, "parse_manifest", counting)
    monkeypatch.setattr("shardkit.checkpoint.format.manifest_cache.parse_manifest", counting)
    return seen


def _save(path, value: float, *, metadata=None) -> str:
    ck.save({"w": torch.full((4, 3), value), "step": int(value)}, str(path), metadata=metadata)
    return str(path)


def test_the_same_bytes_give_the_same_parse_without_parsing_again(tmp_path, parses):
    path = _save(tmp_path / "a", 1.0)
    cache = ManifestCache()
    first = cache.read(*storage_for(path))
    assert cache.read(*storage_for(path)) is first and len(parses) == 1
    assert first.tensors.keys() == read_manifest(*storage_for(path)).tensors.keys()


def test_a_directory_saved_again_is_parsed_again(tmp_path, parses):
    path = _save(tmp_path / "a", 1.0, metadata={"tag": "old"})
    cache = ManifestCache()
    assert cache.read(*storage_for(path)).user_metadata["tag"] == "old"
    shutil.rmtree(path)
    _save(tmp_path / "a", 2.0, metadata={"tag": "new"})
    assert cache.read(*storage_for(path)).user_metadata["tag"] == "new" and len(parses) == 2


def test_it_raises_what_read_manifest_raises_and_caches_no_failure(tmp_path):
    cache = ManifestCache()
    with pytest.raises(MissingShardError):
        cache.read(*storage_for(str(tmp_path / "nothing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(IncompleteCheckpointError):
        cache.read(*storage_for(str(tmp_path / "empty")))
    path = _save(tmp_path / "a", 1.0)
    good = (tmp_path / "a" / METADATA_FILE).read_bytes()
    (tmp_path / "a" / METADATA_FILE).write_bytes(good[:-9])
    with pytest.raises(MetadataError):
        cache.read(*storage_for(path))
    (tmp_path / "a" / METADATA_FILE).write_bytes(good)
    assert cache.read(*storage_for(path)).tensors.keys() == {"w"}


def test_it_keeps_the_most_recently_read_within_its_bounds(tmp_path, parses):
    a, b, c = (_save(tmp_path / n, float(i)) for i, n in enumerate("abc"))
    cache = ManifestCache(max_entries=2)
    for path in (a, b, a, c, a, b):   # c pushes b out (a was read after b); then b is parsed again
        cache.read(*storage_for(path))
    assert [p.split("/")[-2] for p in parses] == ["a", "b", "c", "b"]
    tiny = ManifestCache(max_bytes=10)   # no manifest fits: each read parses
    tiny.read(*storage_for(a))
    tiny.read(*storage_for(a))
    assert [p.split("/")[-2] for p in parses[4:]] == ["a", "a"]


def test_a_managers_rotations_parse_each_steps_manifest_once(tmp_path, parses):
    with CheckpointManager(tmp_path / "run", keep_last=2, async_save=False) as mgr:
        for step in range(6):
            mgr.save(step, {"w": torch.full((4, 3), float(step))}, metrics={"loss": float(step)})
            mgr.wait()
        assert mgr.steps() == [4, 5] and mgr.metrics(5) == {"loss": 5.0}
    parsed = [p.split("/")[-2] for p in parses]
    assert sorted(set(parsed)) == [f"step-{s}" for s in range(6)]
    assert len(parsed) == len(set(parsed))          # without the cache: 4-5 parses per save

"""Glob characters (``[ ] * ?``) in fsspec paths are plain characters (``memory://``, no server needed).

fsspec's ``rm`` / ``mv`` / ``copy`` expand them as patterns; ``FsspecStorage``
must delete and move exact names only, so a run named ``exp[l]`` never touches
a sibling run ``expl``, and a checkpoint saved under ``lr?1`` lands there.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from shardkit.checkpoint import CheckpointManager, load, save, validate_distributed
from shardkit.checkpoint.format.ownership import OWNER_FILE
from shardkit.storage import storage_for

NAMES = ["lr?1", "lr[1]", "exp*", "a[!b]c"]


def _base() -> str:
    return f"memory://shardkit-literal-{uuid.uuid4().hex}"


def _files(url: str) -> list[str]:
    """Every file under ``url``, relative to it."""
    root = fsspec.filesystem("memory")._strip_protocol(url)
    return sorted(p[len(root) + 1:] for p in fsspec.filesystem("memory").find(root))


def _put(store, path: str) -> None:
    with store.atomic_writer(path) as f:
        f.write(b"x")


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_saved_under_a_glob_like_name_is_at_that_name(name):
    base = _base()
    url = f"{base}/runs/{name}/ck"
    state = {"w": torch.arange(6.0)}
    save(state, url)
    assert _files(base) == [f"runs/{name}/ck/metadata.json", f"runs/{name}/ck/rank_0.safetensors"]
    assert validate_distributed(url).ok
    out = {"w": torch.zeros(6)}
    load(out, url)
    assert torch.equal(out["w"], state["w"])


def test_removing_glob_like_names_touches_only_those_names():
    base = _base()
    store, _ = storage_for(base)
    for name in ("exp[l]/a", "expl/a", "expl/b", "f?", "fa", "c[1]/x", "c[1]/sub/y", "c1/x"):
        _put(store, store.join(base, name))
    store.remove(store.join(base, "f?"))
    store.remove_tree(store.join(base, "exp[l]"))
    removed = store.clear_directory(store.join(base, "c[1]"))
    assert sorted(removed) == [store.join(base, "c[1]", "sub"), store.join(base, "c[1]", "x")]
    assert _files(base) == ["c1/x", "expl/a", "expl/b", "fa"]
    assert "exp[l]" not in store.listdir(base)


def test_a_manager_rooted_at_a_glob_like_name_rotates_only_its_own_steps():
    base = _base()
    other = CheckpointManager(f"{base}/runs/expl", keep_last=5, async_save=False)
    other.save(1, {"w": torch.ones(4)})
    other.wait()
    mgr = CheckpointManager(f"{base}/runs/exp[l]", keep_last=1, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
        mgr.wait()
    assert mgr.steps() == [3] and other.steps() == [1]
    assert _files(f"{base}/runs") == [f"{run}/step-{s}/{n}" for run, s in (("exp[l]", 3), ("expl", 1))
                                      for n in (OWNER_FILE, "metadata.json", "rank_0.safetensors")]

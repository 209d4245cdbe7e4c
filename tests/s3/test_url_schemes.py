"""``memory://`` and ``file://`` URLs through the checkpoint and HF APIs (no server needed).

``memory://`` is an fsspec store without atomic uploads: files go under
``storage.temp_name`` and are moved into place, and leftovers are skipped and
cleaned up like local ones.
"""

from __future__ import annotations

import re
import uuid

import fsspec
import pytest
import torch

from shardkit.checkpoint import load_distributed, save_distributed, validate_distributed
from shardkit.errors import MetadataError
from shardkit.hf import find_latest_checkpoint, load_checkpoint, next_checkpoint_path, save_checkpoint
from shardkit.storage import is_temp_name, storage_for, temp_name


def _roundtrip(url: str) -> None:
    state = {"w": torch.randn(30, 4), "step": 5}
    save_distributed(state, url + "/dist", 0, 1, None)
    assert validate_distributed(url + "/dist").ok
    out = load_distributed(url + "/dist", 0, 1)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 5
    path = next_checkpoint_path(url, 7)
    save_checkpoint(path, {"a": torch.ones(3)}, safetensors=True)
    assert torch.equal(load_checkpoint(path)["a"], torch.ones(3))
    assert find_latest_checkpoint(url) == path


def test_memory_urls_and_their_temporary_names():
    url = f"memory://shardkit-{uuid.uuid4().hex}"
    _roundtrip(url)
    store, root = storage_for(url + "/dist")
    assert not [n for n in store.listdir(root) if is_temp_name(n)]  # nothing left behind
    leftover = store.join(root, temp_name("rank_0.safetensors"))
    fsspec.filesystem("memory").pipe(leftover, b"half")
    assert validate_distributed(url + "/dist").ok
    assert store.remove_orphans(root) == [leftover]
    parent = store.join(url, "checkpoints")
    fsspec.filesystem("memory").pipe(store.join(parent, temp_name("checkpoint-9"), "model.safetensors"), b"x")
    assert find_latest_checkpoint(url) == next_checkpoint_path(url, 7)


def test_file_urls(tmp_path):
    _roundtrip(f"file://{tmp_path}")
    assert (tmp_path / "dist" / "metadata.json").exists()


@pytest.mark.parametrize("form", ["file://localhost{}", "file://LOCALHOST{}", "file:{}", "FILE://{}", "File://{}"])
def test_file_url_forms_name_the_local_path(tmp_path, form):
    # RFC 8089: no host or localhost, one slash or three, any case; percent-escapes decoded.
    target = tmp_path / "a b" / "ck"
    url = form.format(str(target.parent).replace(" ", "%20") + "/ck")
    store, path = storage_for(url)
    assert path == str(target)
    save_distributed({"w": torch.ones(3)}, url, 0, 1, None)
    assert (target / "metadata.json").exists()
    assert torch.equal(load_distributed(url, 0, 1)["w"], torch.ones(3))


@pytest.mark.parametrize("url, says", [
    ("file://server/share/ck", "names the host 'server'"),
    ("file://tmp/ck", "names the host 'tmp'"),          # two slashes: 'tmp' is a host
    ("file:relative/ck", "not an absolute path"),
    ("file:///tmp/lr?1", "query or fragment"),
])
def test_file_urls_that_name_no_local_path_are_refused(url, says):
    with pytest.raises(MetadataError, match=re.escape(says)):
        storage_for(url)


@pytest.mark.parametrize("url", ["s3://", "s3:///ck", "S3://", "gs://"])
def test_object_store_urls_that_name_no_bucket_are_refused_before_any_request(url):
    with pytest.raises(MetadataError, match=re.escape(f"{url!r} names no bucket")):
        storage_for(url)
    with pytest.raises(MetadataError, match="names no bucket"):
        load_distributed(url, 0, 1)

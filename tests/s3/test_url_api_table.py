"""Every public entry of ``shardkit.checkpoint`` and ``shardkit.hf``, and the CLI, on every URL scheme.

One table: each row exercises a group of APIs on a root URL; each row runs on
``memory://`` (in process, no server), ``file://`` and ``s3://`` (the
session's SeaweedFS server, conftest.py; started only when an ``s3`` row runs).
A row asserts what comes back and, where it matters, what is left in the store.
"""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest
import torch

import shardkit.checkpoint as ckpt
import shardkit.hf as hf
from shardkit.checkpoint.format.ownership import OWNER_FILE
from shardkit.cli import main as cli
from shardkit.errors import CheckpointError
from shardkit.storage import storage_for, temp_name


def _state(v: float = 1.0) -> dict:
    return {"model": {"w": torch.arange(32.0).reshape(8, 4) * v, "b": torch.ones(3) * v},
            "optim": {"lr": 0.01, "betas": [0.9, 0.99]}, "step": int(v)}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(3)}, "optim": {"lr": 0.0, "betas": [0.0, 0.0]},
            "step": 0}


def _same(a: dict, b: dict) -> None:
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
    assert a["optim"] == b["optim"] and a["step"] == b["step"]


def _names(url: str) -> list[str]:
    store, root = storage_for(url)
    return store.listdir(root)


def row_dcp_save_load_and_rank_state(url):
    rng = {"torch": torch.get_rng_state(), "pos": 17}
    ckpt.save(_state(2), url + "/d", rank_state=rng)
    back, got = _empty(), {"torch": torch.zeros_like(rng["torch"]), "pos": 0}
    ckpt.load(back, url + "/d", rank_state=got)
    _same(back, _state(2))
    assert torch.equal(got["torch"], rng["torch"]) and got["pos"] == 17
    assert sorted(_names(url + "/d")) == ["metadata.json", "rank_0.safetensors"]


def row_async_save_and_async_checkpointer(url):
    ckpt.async_save(_state(3), url + "/a").wait()
    back = _empty()
    ckpt.load(back, url + "/a")
    _same(back, _state(3))
    saver = ckpt.AsyncCheckpointer(url + "/b", 0, 1, None)
    saver.save_async({"w": torch.full((5,), 4.0), "step": 4}).wait()
    future = saver.save_async({"w": torch.full((5,), 5.0), "step": 5}, dir=url + "/c")
    future.wait()
    assert future.done()
    assert torch.equal(ckpt.load_distributed(url + "/b", 0, 1)["w"], torch.full((5,), 4.0))
    assert ckpt.load_distributed(url + "/c", 0, 1)["step"] == 5


def row_distributed_save_load_reshard_validate(url):
    d = url + "/dist"
    w = torch.arange(40.0).reshape(10, 4)
    spec = ckpt.ShardMetadata(1, {"w": ckpt.TensorShardSpec((10, 4), 0, (10,))})
    ckpt.save_distributed({"w": w, "scale": torch.tensor(2.0), "step": 9}, d, 0, 1, spec, metadata={"run": "x"})
    assert ckpt.validate_distributed(d).ok
    assert ckpt.read_metadata(d).num_ranks == 1
    assert torch.equal(ckpt.load_distributed(d, 1, 2)["w"], w[5:])             # resharded on load
    assert torch.equal(ckpt.reshard(d, 1, 2, 0)["w"], w[:5])
    assert torch.equal(ckpt.load_region(d, "w", (2, 1), (3, 2)), w[2:5, 1:3])
    assert torch.equal(ckpt.load_consolidated(d, keys={"w"})["w"], w)
    with ckpt.open_checkpoint(d) as ck:
        assert set(ck.manifest.tensors) == {"w", "scale"}
    assert not ckpt.validate_distributed(url + "/absent").ok


def row_manager(url):
    root = url + "/run"
    fsspec_pipe(root + "/step-0/" + OWNER_FILE, b"{}")                  # a crashed save: its mark,
    fsspec_pipe(root + "/step-0/rank_0.safetensors", b"a crashed save")  # and half its data
    fsspec_pipe(f"{root}/{temp_name('step-7')}/metadata.json", b"{}")
    with ckpt.CheckpointManager(root, keep_last=2, best=("loss", "min")) as mgr:
        assert mgr.steps() == []
        for step, loss in [(1, 3.0), (2, 0.5), (3, 2.0), (4, 4.0)]:
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.wait()
        assert mgr.steps() == [2, 3, 4] and mgr.latest_step() == 4 and mgr.metrics(2) == {"loss": 0.5}
    assert sorted(_names(root)) == ["step-2", "step-3", "step-4"]   # the crashed step and temporary gone
    back = _empty()
    assert ckpt.CheckpointManager(root, async_save=False).restore(back) == 4
    _same(back, _state(4))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.CheckpointManager(root).restore(_empty(), step=1)


def row_hf_save_load_index_and_metrics(url):
    sd = {"a": torch.randn(30, 4), "b": torch.randn(20), "c": torch.arange(6)}
    d = url + "/hfm"
    hf.save_checkpoint(d, sd, safetensors=True, max_shard_size=300)
    meta = hf.get_checkpoint_metadata(d)
    assert meta.is_index and meta.file_name == hf.index_file_name(True) and hf.validate_checkpoint(d)
    index = hf.load_shard_index(d, hf.index_file_name(True))
    assert set(index["weight_map"]) == set(sd)
    back = hf.load_checkpoint(d)
    assert all(torch.equal(back[n], sd[n]) for n in sd)
    d2 = url + "/hfs"
    index2 = hf.make_shard_index([sd], safetensors=False, max_shard_size=300)
    hf.save_sharded_checkpoint(d2, index2, sd, safetensors=False)
    hf.save_shard_index(index2, d2, hf.index_file_name(False))
    back2 = hf.load_sharded_checkpoint(d2, index2, safetensors=False)
    assert all(torch.equal(back2[n], sd[n]) for n in sd) and hf.validate_checkpoint(d2)
    hf.save_checkpoint_metrics(d, {"loss": 0.25})
    assert hf.load_checkpoint_metrics(d) == {"loss": 0.25}


def row_hf_directory_of_checkpoints(url):
    for i in (1, 2, 3):
        hf.save_checkpoint(hf.next_checkpoint_path(url, i), {"w": torch.full((4,), float(i))}, safetensors=True)
    ckpt.save({"w": torch.full((4,), 4.0)}, hf.next_checkpoint_path(url, 4))    # distributed, counts too
    broken = hf.next_checkpoint_path(url, 5)
    fsspec_pipe(broken + "/model-00001-of-00002.safetensors", b"partial")
    assert hf.find_latest_checkpoint(url) == hf.next_checkpoint_path(url, 4)
    assert hf.get_checkpoint_metadata(hf.next_checkpoint_path(url, 4)).distributed
    hf.maybe_delete_oldest_checkpoint(url, 2, best_checkpoint=hf.next_checkpoint_path(url, 1))
    assert hf.list_checkpoints(url) == [hf.next_checkpoint_path(url, i) for i in (1, 4)]
    assert "checkpoint-2" not in _names(url + "/checkpoints")                   # every object, and the prefix
    assert _names(broken)                                                        # incomplete: never touched


def row_hf_pretrained_links(url):
    hf.save_checkpoint(hf.next_checkpoint_path(url, 1), {"w": torch.ones(3)}, safetensors=True)
    if url.startswith("file://"):
        links = hf.create_pretrained_symlinks(url)
        assert links[-1].endswith("/model.safetensors.index.json") and all(os.path.islink(p) for p in links)
        assert torch.equal(hf.load_checkpoint(url)["w"], torch.ones(3))         # through the link
    else:
        with pytest.raises(CheckpointError, match="without symbolic links"):
            hf.create_pretrained_symlinks(url, dry_run=True)
        assert sorted(_names(url)) == ["checkpoints"]                           # nothing made, here or locally


def row_hf_convert(url):
    sd = {"x": torch.randn(6, 4), "y": torch.randn(5)}
    hf.save_checkpoint(url + "/h", sd, safetensors=True)
    hf.hf_to_distributed(url + "/h", url + "/d", world_size=2)
    assert ckpt.validate_distributed(url + "/d").ok
    hf.distributed_to_hf(url + "/d", url + "/h2", max_shard_size=60)
    back = hf.load_checkpoint(url + "/h2")
    assert all(torch.equal(back[n], sd[n]) for n in sd)


def row_cli(url, capsys):
    ckpt.save(_state(1), url + "/a")
    ckpt.save(_state(1), url + "/b")
    assert cli(["inspect", url + "/a"]) == 0
    assert cli(["validate", url + "/a"]) == 0
    assert cli(["diff", url + "/a", url + "/b"]) == 0
    assert cli(["reshard", url + "/a", url + "/r", "--world-size", "2", "-q"]) == 0
    assert ckpt.validate_distributed(url + "/r").ok and ckpt.read_metadata(url + "/r").num_ranks == 2
    assert cli(["convert", url + "/a", url + "/h", "--to", "hf", "-q"]) == 0
    assert hf.validate_checkpoint(url + "/h")
    assert cli(["convert", url + "/h", url + "/d2", "--to", "distributed", "-q", "--json"]) == 0
    capsys.readouterr()
    assert cli(["validate", url + "/absent"]) != 0


def fsspec_pipe(url: str, data: bytes) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe(path, data)


ROWS = [row_dcp_save_load_and_rank_state, row_async_save_and_async_checkpointer,
        row_distributed_save_load_reshard_validate, row_manager, row_hf_save_load_index_and_metrics,
        row_hf_directory_of_checkpoints, row_hf_pretrained_links, row_hf_convert, row_cli]


@pytest.fixture(params=["memory", "file", "s3"])
def root_url(request, tmp_path):
    if request.param == "s3":
        yield request.getfixturevalue("s3_url")
    elif request.param == "file":
        yield f"file://{tmp_path}"
    else:
        url = f"memory://shardkit-table-{uuid.uuid4().hex}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


@pytest.mark.parametrize("row", ROWS, ids=[r.__name__[4:] for r in ROWS])
def test_api_on_url(row, root_url, capsys):
    if row is row_cli:
        row(root_url, capsys)
    else:
        row(root_url)

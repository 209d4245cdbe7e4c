"""from_pretrained(model_dir) and shardkit never read different weights from one directory.

transformers looks for ``model.safetensors`` before the index: a weight file
left in a run directory by an earlier ``save_pretrained`` would be loaded
instead of the links to the latest checkpoint. ``create_pretrained_symlinks``
refuses to link next to one (``force_overwrite`` deletes it), and shardkit's
own directory reading follows transformers' order.
"""

import os

import pytest
import safetensors.torch as st
import torch
from hf_helpers import assert_same_state, tiny_llama

from shardkit.errors import CheckpointExistsError
from shardkit.hf import get_checkpoint_metadata, load_checkpoint, next_checkpoint_path, save_checkpoint
from shardkit.hf.links import create_pretrained_symlinks

OLD, NEW = {"w": torch.zeros(64)}, {"w": torch.ones(64)}


def _sharded_latest(model_dir, sd=NEW, ckpt_id=1):
    save_checkpoint(next_checkpoint_path(str(model_dir), ckpt_id), sd, safetensors=True, max_shard_size=128)


def _entries(model_dir):
    return {n: os.readlink(model_dir / n) if os.path.islink(model_dir / n) else "file"
            for n in os.listdir(model_dir) if n != "checkpoints"}


@pytest.mark.parametrize("stale", ["model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json",
                                   "model-00009-of-00009.safetensors"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_stale_weight_file_next_to_the_links_is_refused(tmp_path, stale, dry_run):
    (tmp_path / stale).write_bytes(b"earlier weights")
    _sharded_latest(tmp_path)
    before = _entries(tmp_path)
    with pytest.raises(CheckpointExistsError, match=f"holds {stale}, weights that are not the latest") as e:
        create_pretrained_symlinks(str(tmp_path), dry_run=dry_run)
    assert "force_overwrite=True" in str(e.value)
    assert _entries(tmp_path) == before  # nothing made, nothing removed


def test_force_overwrite_deletes_the_stale_file_and_links_the_latest(tmp_path):
    st.save_file(OLD, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _sharded_latest(tmp_path)
    assert create_pretrained_symlinks(str(tmp_path), force_overwrite=True, dry_run=True)
    assert os.path.isfile(tmp_path / "model.safetensors")  # a dry run deletes nothing
    links = create_pretrained_symlinks(str(tmp_path), force_overwrite=True)
    assert not os.path.lexists(tmp_path / "model.safetensors")
    assert all(os.path.islink(p) for p in links)
    assert torch.equal(load_checkpoint(str(tmp_path), None)["w"], NEW["w"])


def test_a_foreign_symlink_is_in_the_way_but_our_own_older_links_are_not(tmp_path):
    (tmp_path / "elsewhere.safetensors").write_bytes(b"x")
    os.symlink("elsewhere.safetensors", tmp_path / "model.safetensors")
    _sharded_latest(tmp_path)
    with pytest.raises(CheckpointExistsError, match="model.safetensors"):
        create_pretrained_symlinks(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    # An older single-file checkpoint linked as model.safetensors, then a sharded one: the old link goes quietly.
    save_checkpoint(next_checkpoint_path(str(tmp_path), 0), OLD, safetensors=True)
    os.symlink(os.path.join("checkpoints", "checkpoint-0", "model.safetensors"), tmp_path / "model.safetensors")
    create_pretrained_symlinks(str(tmp_path))
    assert not os.path.lexists(tmp_path / "model.safetensors")
    assert os.readlink(tmp_path / "model.safetensors.index.json").startswith(os.path.join("checkpoints", "checkpoint-1"))


def test_unrelated_files_are_not_in_the_way_and_a_directory_never_is_removed(tmp_path):
    for name in ("config.json", "model.bin", "model.safetensors.bak", "notes.txt"):
        (tmp_path / name).write_text("mine")
    _sharded_latest(tmp_path)
    create_pretrained_symlinks(str(tmp_path))
    (tmp_path / "pytorch_model.bin").mkdir()
    with pytest.raises(CheckpointExistsError, match="never directories"):
        create_pretrained_symlinks(str(tmp_path), force_overwrite=True)
    assert os.path.isdir(tmp_path / "pytorch_model.bin")


@pytest.mark.parametrize("safetensors", [True, False])
def test_directory_reading_follows_from_pretrained_order(tmp_path, safetensors):
    save_checkpoint(str(tmp_path), NEW, safetensors=safetensors)  # an index and its shard
    single = "model.safetensors" if safetensors else "pytorch_model.bin"
    if safetensors:
        st.save_file(OLD, str(tmp_path / single), metadata={"format": "pt"})
    else:
        torch.save(OLD, tmp_path / single)
    meta = get_checkpoint_metadata(str(tmp_path))
    assert (meta.file_name, meta.is_index) == (single, False)  # transformers checks the single file first
    assert torch.equal(load_checkpoint(str(tmp_path), None)["w"], OLD["w"])


def test_from_pretrained_and_shardkit_agree_on_a_run_directory(tmp_path):
    from transformers import LlamaForCausalLM

    old, new = tiny_llama(seed=1), tiny_llama(seed=2)
    old.save_pretrained(str(tmp_path))  # e.g. the initial weights, saved into the run directory
    save_checkpoint(next_checkpoint_path(str(tmp_path), 100), new, safetensors=True, max_shard_size=20_000)
    with pytest.raises(CheckpointExistsError, match="model.safetensors"):
        create_pretrained_symlinks(str(tmp_path))
    shardkit_view = tiny_llama(seed=3)
    load_checkpoint(str(tmp_path), shardkit_view)
    assert_same_state(LlamaForCausalLM.from_pretrained(str(tmp_path)), shardkit_view)  # same weights, both old
    create_pretrained_symlinks(str(tmp_path), force_overwrite=True)
    assert_same_state(LlamaForCausalLM.from_pretrained(str(tmp_path)), new)
    shardkit_view = tiny_llama(seed=3)
    load_checkpoint(str(tmp_path), shardkit_view)
    assert_same_state(shardkit_view, new)

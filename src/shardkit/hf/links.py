"""Links from a model directory to its latest checkpoint, so ``from_pretrained(model_dir)`` works.

Each weight file of the latest complete checkpoint gets a **relative**
symlink in ``model_dir`` (the directory can be moved or mounted elsewhere),
shards first and the index last. Links left from an older checkpoint are
replaced; a regular file in the way raises ``CheckpointExistsError`` unless
``force_overwrite``. This module does not copy data or write configs, and makes no links on
object stores (``s3://``...: none exist there; it raises ``CheckpointError``).

Example::

    create_pretrained_symlinks("run")       # run/model.safetensors.index.json -> checkpoints/checkpoint-9/...
    AutoModelForCausalLM.from_pretrained("run")
"""

from __future__ import annotations

import logging
import os
from typing import List

from shardkit.errors import CheckpointError, CheckpointExistsError, MissingShardError
from shardkit.hf.directory import find_latest_checkpoint, get_checkpoint_metadata
from shardkit.hf.index import load_shard_index
from shardkit.storage import storage_for, temp_name

__all__ = ["create_pretrained_symlinks"]

log = logging.getLogger(__name__)


def _weight_files(checkpoint: str) -> List[str]:
    meta = get_checkpoint_metadata(checkpoint)
    if meta is None or meta.distributed:
        raise MissingShardError(f"{checkpoint} holds no Hugging Face checkpoint to link to")
    if not meta.is_index:
        return [meta.file_name]
    index = load_shard_index(checkpoint, meta.file_name)
    return list(dict.fromkeys(index["weight_map"].values())) + [meta.file_name]


def create_pretrained_symlinks(model_dir: str, force_overwrite: bool = False, dry_run: bool = False) -> List[str]:
    """Link the latest checkpoint's weight files into ``model_dir``; return the link paths.

    With ``dry_run`` nothing changes and the links that would be made are
    returned. A user who asks for links hears why none were made, as with
    forgather: ``MissingShardError`` (a ``FileNotFoundError``) when there is
    no complete checkpoint under ``model_dir/checkpoints``, and
    ``CheckpointExistsError`` (a ``FileExistsError``) when something that is
    not a symlink is where a link would go and ``force_overwrite`` is False.
    Both are raised before any link is made (also with ``dry_run``).
    ``force_overwrite`` replaces regular files, never directories.
    """
    store, model_dir = storage_for(model_dir)
    if not store.has_symlinks:
        raise CheckpointError(
            f"{model_dir} is on a store without symbolic links (an object store), so no link to the latest "
            f"checkpoint can be made there, and from_pretrained reads local directories only: download the "
            f"checkpoint find_latest_checkpoint({model_dir!r}) names and load that"
        )
    latest = find_latest_checkpoint(model_dir)
    if latest is None:
        raise MissingShardError(
            f"{model_dir} holds no complete checkpoint to link to (looked for checkpoints/checkpoint-* with a "
            f"weight file or index); save one first, e.g. with save_checkpoint(next_checkpoint_path(...), model)"
        )
    files = _weight_files(latest)
    links = [os.path.join(model_dir, name) for name in files]
    _check_nothing_in_the_way(links, force_overwrite)
    if dry_run:
        return links
    rel_dir = os.path.relpath(latest, model_dir)
    for name, link in zip(files, links):
        if os.path.lexists(link) and not os.path.islink(link):
            log.warning("replacing the regular file %s with a link (force_overwrite=True)", link)
        _replace_with_link(os.path.join(rel_dir, name), link)
    _remove_stale_links(model_dir, set(files))
    return links


def _check_nothing_in_the_way(links: List[str], force_overwrite: bool) -> None:
    """Raise ``CheckpointExistsError`` for anything but a symlink (or, when forcing, a file) at a link path."""
    for link in links:
        if not os.path.lexists(link) or os.path.islink(link):
            continue
        if os.path.isdir(link):
            raise CheckpointExistsError(
                f"{link} is a directory, where a link to the latest checkpoint's file would go; move it away "
                f"(force_overwrite replaces files, never directories)"
            )
        if not force_overwrite:
            raise CheckpointExistsError(
                f"{link} is a regular file, where a link to the latest checkpoint's file would go; no link was "
                f"made. Move it away, or pass force_overwrite=True to replace it"
            )


def _replace_with_link(target: str, link: str) -> None:
    tmp = os.path.join(os.path.dirname(link), temp_name(os.path.basename(link)))
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: a reader sees the old link or the new one


def _remove_stale_links(model_dir: str, current: set) -> None:
    prefix = "checkpoints" + os.sep
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if name not in current and os.path.islink(path) and os.readlink(path).startswith(prefix):
            if name.startswith(("model", "pytorch_model")):
                os.remove(path)

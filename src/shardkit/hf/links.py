"""Links from a model directory to its latest checkpoint, so ``from_pretrained(model_dir)`` works.

Each weight file of the latest complete checkpoint gets a **relative**
symlink in ``model_dir`` (the directory can be moved or mounted elsewhere),
shards first and the index last. Links left from an older checkpoint are
replaced; a regular file in the way is kept unless ``force_overwrite``. This
module does not copy data or write configs.

Example::

    create_pretrained_symlinks("run")       # run/model.safetensors.index.json -> checkpoints/checkpoint-9/...
    AutoModelForCausalLM.from_pretrained("run")
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import List

from shardkit.errors import MissingShardError
from shardkit.hf.directory import find_latest_checkpoint, get_checkpoint_metadata
from shardkit.hf.index import load_shard_index

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
    returned. Returns ``[]`` when there is no complete checkpoint.
    """
    latest = find_latest_checkpoint(model_dir)
    if latest is None:
        return []
    files = _weight_files(latest)
    rel_dir = os.path.relpath(latest, model_dir)
    made = []
    for name in files:
        link = os.path.join(model_dir, name)
        if os.path.exists(link) and not os.path.islink(link) and not force_overwrite:
            log.warning("%s is a regular file; not replacing it (pass force_overwrite=True)", link)
            continue
        made.append(link)
        if not dry_run:
            _replace_with_link(os.path.join(rel_dir, name), link)
    if not dry_run:
        _remove_stale_links(model_dir, set(files))
    return made


def _replace_with_link(target: str, link: str) -> None:
    tmp = os.path.join(os.path.dirname(link), f".{os.path.basename(link)}.{secrets.token_hex(4)}.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: a reader sees the old link or the new one


def _remove_stale_links(model_dir: str, current: set) -> None:
    prefix = "checkpoints" + os.sep
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if name not in current and os.path.islink(path) and os.readlink(path).startswith(prefix):
            if name.startswith(("model", "pytorch_model")):
                os.remove(path)

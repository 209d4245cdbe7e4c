"""Links from a model directory to its latest checkpoint, so ``from_pretrained(model_dir)`` works.

Each weight file of the latest complete checkpoint gets a **relative**
symlink in ``model_dir`` (the directory can be moved or mounted elsewhere),
shards first and the index last. Links left from an older checkpoint are
replaced; a regular file in the way raises ``CheckpointExistsError`` unless
``force_overwrite``. So does any other weight file or index in ``model_dir``
(e.g. a ``model.safetensors`` from an earlier ``save_pretrained``):
``from_pretrained`` would load it instead of the links. This module does not copy data or write configs, and makes no links on
object stores (``s3://``...: none exist there; it raises ``CheckpointError``).

Example::

    create_pretrained_symlinks("run")       # run/model.safetensors.index.json -> checkpoints/checkpoint-9/...
    AutoModelForCausalLM.from_pretrained("run")
"""

from __future__ import annotations

import logging
import os
import re
from typing import List

from shardkit.errors import CheckpointError, CheckpointExistsError, MissingShardError
from shardkit.hf.directory import find_latest_checkpoint, get_checkpoint_metadata
from shardkit.hf.index import load_shard_index
from shardkit.storage import storage_for, temp_name

__all__ = ["create_pretrained_symlinks"]

log = logging.getLogger(__name__)

#: Names ``from_pretrained`` (or an index it reads) loads weights from: single files, shards, indexes.
_WEIGHT_NAME_RE = re.compile(r"^(model(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin)(\.index\.json)?$")


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
    not a symlink is where a link would go, or when ``model_dir`` holds any
    other weight file or index (``model*.safetensors``, ``pytorch_model*.bin``,
    their indexes) that is not a link this function made: transformers looks
    for ``model.safetensors`` before the index, so it would load those stale
    weights instead of the links. Both are raised before any link is made
    (also with ``dry_run``). ``force_overwrite`` replaces the files in the way
    and deletes the other weight files, never directories.
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
    others = _other_weight_files(model_dir, set(files))
    _check_no_other_weights(model_dir, others, force_overwrite)
    if dry_run:
        return links
    for path in others:  # first: from here on, from_pretrained can find only the old links or the new ones
        log.warning("removing %s, weights that are not the latest checkpoint's (force_overwrite=True)", path)
        os.remove(path)
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


def _other_weight_files(model_dir: str, linked: set) -> List[str]:
    """Weight files and indexes in ``model_dir`` that are neither being linked nor links to a checkpoint."""
    found = []
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name not in linked and _WEIGHT_NAME_RE.match(name) and not _is_checkpoint_link(path):
            found.append(path)
    return found


def _check_no_other_weights(model_dir: str, others: List[str], force_overwrite: bool) -> None:
    """Raise ``CheckpointExistsError`` for other weights next to the links (always, for a directory)."""
    dirs = [p for p in others if os.path.isdir(p) and not os.path.islink(p)]
    if not others or (force_overwrite and not dirs):
        return
    names = [os.path.basename(p) for p in dirs or others]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    fix = "move them away (force_overwrite deletes files, never directories)" if dirs else \
        "move them away, or pass force_overwrite=True to delete them"
    raise CheckpointExistsError(
        f"{model_dir} holds {', '.join(names[:3])}{more}, weights that are not the latest checkpoint's; "
        f"from_pretrained({model_dir!r}) looks for model.safetensors before the index, so it could load those "
        f"instead of the links. No link was made: {fix}"
    )


def _is_checkpoint_link(path: str) -> bool:
    """Whether ``path`` is a link this module made (relative, into ``checkpoints/``)."""
    return os.path.islink(path) and os.readlink(path).startswith("checkpoints" + os.sep)


def _replace_with_link(target: str, link: str) -> None:
    tmp = os.path.join(os.path.dirname(link), temp_name(os.path.basename(link)))
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: a reader sees the old link or the new one


def _remove_stale_links(model_dir: str, current: set) -> None:
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if name not in current and _is_checkpoint_link(path) and name.startswith(("model", "pytorch_model")):
            os.remove(path)

"""A directory of checkpoints: which are complete, which is latest, which to delete.

Layout: ``<model_dir>/checkpoints/checkpoint-<id>/``, each one checkpoint in
either Hugging Face layout (or a shardkit distributed checkpoint). Only a
**complete** checkpoint is valid, latest, or counted: its index (written last)
is present and every file it names exists with a readable header whose
tensors cover the file exactly. "Latest" is the highest numeric id when checkpoints
have one, else the newest index modification time. This module never
loads tensors.

Example::

    path = next_checkpoint_path("run", 1200)           # run/checkpoints/checkpoint-1200
    save_checkpoint(path, model, safetensors=True)
    maybe_delete_oldest_checkpoint("run", max_checkpoints=3, best_checkpoint=best)
    latest = find_latest_checkpoint("run")
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import List, Optional

from shardkit.errors import MetadataError, MissingShardError, ShardkitError
from shardkit.hf.bin_io import bin_looks_complete
from shardkit.hf.index import (
    BIN_INDEX_NAME,
    BIN_WEIGHTS_NAME,
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    load_shard_index,
)
from shardkit.hf.shard_io import shard_header
from shardkit.hf.untrusted import PARSE_FAILURES, non_regular_problems, require_regular_file
from shardkit.storage import is_temp_name, storage_for

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointMeta",
    "CHECKPOINTS_DIR",
    "DISTRIBUTED_METADATA_NAME",
    "get_checkpoint_metadata",
    "hf_layout",
    "validate_checkpoint",
    "checkpoint_problems",
    "find_latest_checkpoint",
    "list_checkpoints",
    "next_checkpoint_path",
    "maybe_delete_oldest_checkpoint",
]

CHECKPOINTS_DIR = "checkpoints"
DISTRIBUTED_METADATA_NAME = "metadata.json"
_ID_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class CheckpointMeta:
    """What kind of checkpoint a directory holds.

    ``file_name`` is the index (or single weights file); ``distributed`` is
    True for a shardkit distributed checkpoint (``metadata.json``).
    """

    file_name: str
    is_index: bool
    safetensors: bool
    distributed: bool = False


#: The layout of each commit marker the one detector (``shardkit.format_detect``) knows.
_CANDIDATES = {
    SAFE_WEIGHTS_NAME: CheckpointMeta(SAFE_WEIGHTS_NAME, False, True),
    SAFE_INDEX_NAME: CheckpointMeta(SAFE_INDEX_NAME, True, True),
    BIN_WEIGHTS_NAME: CheckpointMeta(BIN_WEIGHTS_NAME, False, False),
    BIN_INDEX_NAME: CheckpointMeta(BIN_INDEX_NAME, True, False),
    DISTRIBUTED_METADATA_NAME: CheckpointMeta(DISTRIBUTED_METADATA_NAME, True, True, distributed=True),
}


def get_checkpoint_metadata(path: str) -> Optional[CheckpointMeta]:
    """The layout of the checkpoint in ``path``, or None when there is none (or only a DCP one).

    Looks only at which files exist; :func:`validate_checkpoint` checks them.
    The choice is the one detector's (:func:`shardkit.format_detect.find_format`),
    so every reader sees one kind per directory: ``metadata.json`` (a shardkit
    distributed checkpoint) first, then, in ``from_pretrained``'s order,
    ``model.safetensors``, ``model.safetensors.index.json``,
    ``pytorch_model.bin``, its index -- among Hugging Face files shardkit and
    transformers never read different weights from one directory. It does
    not warn about the others; ``save_checkpoint`` removes them, and
    :func:`~shardkit.hf.create_pretrained_symlinks` refuses to link next to them.
    """
    from shardkit.format_detect import find_format

    try:
        found = find_format(path)
    except MetadataError:  # a file, not a directory: no checkpoint
        return None
    return _CANDIDATES.get(found.marker) if found is not None else None


def hf_layout(path: str) -> Optional[CheckpointMeta]:
    """The Hugging Face layout in ``path`` (``from_pretrained``'s order), whatever else the directory holds,
    or None: what a reader asked for the Hugging Face checkpoint there reads (``convert --from hf``)."""
    from shardkit.format_detect import HF, first_marker

    try:
        return _CANDIDATES.get(first_marker(path, HF) or "")
    except MetadataError:
        return None


def validate_checkpoint(checkpoint_path: str) -> bool:
    """True if ``checkpoint_path`` holds a complete checkpoint.

    Every file the index names must exist and have a readable header whose
    tensors cover the file exactly, with no key twice (``storage.read_header``;
    ``.bin``: an intact zip directory), and
    every tensor the index places in a file must be in its header. Never
    raises for a bad checkpoint; see :func:`checkpoint_problems` for why.
    """
    return not checkpoint_problems(checkpoint_path)


def checkpoint_problems(checkpoint_path: str) -> List[str]:
    """Why ``checkpoint_path`` is not a complete checkpoint (``[]`` when it is).

    Never raises for what is on disk: a damaged or hostile file, a FIFO or a
    directory where a file should be, even an unexpected failure while
    checking, each becomes a line. Opens no file that is not a regular file.
    """
    try:
        return _problems(checkpoint_path)
    except (ShardkitError, OSError, *PARSE_FAILURES) as e:
        return [f"{checkpoint_path}: {e}"]
    except Exception as e:  # noqa: BLE001 -- "never raises": a bug here must not stop a resume
        return [f"{checkpoint_path}: unexpected {type(e).__name__} while checking it ({e})"]


def _problems(checkpoint_path: str) -> List[str]:
    store, root = storage_for(checkpoint_path)
    if not store.isdir(root):
        return [f"{checkpoint_path} is not a directory"]
    meta = get_checkpoint_metadata(checkpoint_path)
    if meta is None:
        return [f"{checkpoint_path} has no index, weights file or metadata.json"]
    not_files = non_regular_problems(store, root)
    if not_files:
        return not_files
    if meta.distributed:
        return _distributed_problems(checkpoint_path)
    if not meta.is_index:
        return _file_problems(checkpoint_path, meta.file_name, None, meta.safetensors)
    index = load_shard_index(checkpoint_path, meta.file_name)
    by_file: dict[str, list[str]] = {}
    for name, file_name in index["weight_map"].items():
        by_file.setdefault(file_name, []).append(name)
    problems: List[str] = []
    for file_name, names in by_file.items():
        problems += _file_problems(checkpoint_path, file_name, names, meta.safetensors)
    return problems


def _file_problems(root: str, file_name: str, names: Optional[list], safetensors: bool) -> List[str]:
    store, base = storage_for(root)
    path = store.join(base, file_name)
    if not store.exists(path):
        return [f"{path} is missing"]
    try:
        require_regular_file(store, path)
    except (MetadataError, MissingShardError) as e:
        return [str(e)]
    if not safetensors:
        return [] if bin_looks_complete(store, path) else [f"{path} is truncated or not a torch.save file"]
    try:
        header = shard_header(store, path)  # also refuses bytes no tensor describes: gaps, appended bytes
    except (MetadataError, MissingShardError) as e:
        return [str(e)]
    absent = [n for n in names or [] if n not in header.tensors]
    return [f"{path} lacks {len(absent)} tensors the index places there, e.g. {absent[:3]}"] if absent else []


def _distributed_problems(path: str) -> List[str]:
    try:
        from shardkit.checkpoint.loading.validate import validate_distributed
    except ImportError:
        return [f"{path} looks like a distributed checkpoint, but shardkit.checkpoint is not available"]
    report = validate_distributed(path)
    return [] if report.ok else list(report.problems) or [f"{path} is not a complete distributed checkpoint"]


def _checkpoint_id(path: str) -> Optional[int]:
    match = _ID_RE.match(os.path.basename(path.rstrip("/")))
    return int(match.group(1)) if match else None


def _commit_time(path: str) -> float:
    store, root = storage_for(path)
    meta = get_checkpoint_metadata(path)
    if meta is None:
        return 0.0
    try:
        return store.modified_time(store.join(root, meta.file_name))
    except OSError:  # deleted since it was checked: order it first, it goes no further
        return 0.0


def list_checkpoints(model_dir: str) -> List[str]:
    """Complete checkpoints under ``model_dir/checkpoints``, oldest first.

    Ordered by numeric id (``checkpoint-<id>``) where there is one; those
    without an id come first, by index modification time. Incomplete ones
    (a save that never finished), broken ones and temporary names
    (``storage.is_temp_name``) are not listed; this never raises for what a
    checkpoint directory holds. ``model_dir`` may be a URL (``s3://...``).
    """
    return _scan(model_dir)[0]


def _scan(model_dir: str) -> tuple[List[str], dict[str, List[str]]]:
    """(complete checkpoints, oldest first; {skipped directory: its problems})."""
    store, root = storage_for(model_dir)
    parent = store.join(root, CHECKPOINTS_DIR)
    if not store.isdir(parent):
        return [], {}
    valid, skipped = [], {}
    for path in (store.join(parent, n) for n in store.listdir(parent) if not is_temp_name(n)):
        if not store.isdir(path):
            continue
        problems = checkpoint_problems(path)
        if problems:
            skipped[path] = problems
        else:
            valid.append(path)
    return sorted(valid, key=_order_key), skipped


def _order_key(path: str) -> tuple:
    ckpt_id = _checkpoint_id(path)
    return (ckpt_id is not None, ckpt_id if ckpt_id is not None else 0, _commit_time(path))


def find_latest_checkpoint(model_dir: str) -> Optional[str]:
    """The newest complete checkpoint under ``model_dir/checkpoints``, or None.

    A checkpoint whose save was interrupted, or that is damaged, is never
    returned: it is skipped with a ``logging`` warning that says why, and an
    older complete one is returned instead. Never raises for what a
    checkpoint directory holds.
    """
    found, skipped = _scan(model_dir)
    for path, problems in skipped.items():
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        log.warning("find_latest_checkpoint: skipping %s: %s%s", path, problems[0], more)
    return found[-1] if found else None


def next_checkpoint_path(model_dir: str, checkpoint_id) -> str:
    """``model_dir/checkpoints/checkpoint-<checkpoint_id>`` (not created), spelled as
    :func:`list_checkpoints` returns it (``file://`` dropped, other URLs kept)."""
    store, root = storage_for(model_dir)
    return store.join(root, CHECKPOINTS_DIR, f"checkpoint-{checkpoint_id}")


def maybe_delete_oldest_checkpoint(
    model_dir: str,
    max_checkpoints: int,
    best_checkpoint: Optional[str] = None,
    preserved_checkpoints: Optional[List[str]] = None,
) -> None:
    """Delete the oldest complete checkpoints until at most ``max_checkpoints`` remain.

    Never deletes ``best_checkpoint`` or any of ``preserved_checkpoints``
    (they still count toward the limit), and never touches incomplete
    checkpoints (a save may be in progress). Each deletion removes the index
    first, so a crash mid-delete leaves an incomplete, ignored directory.
    """
    if max_checkpoints < 0:
        raise MetadataError(f"max_checkpoints must be >= 0 (how many complete checkpoints to keep), got {max_checkpoints}")
    store, _ = storage_for(model_dir)
    keep = {store.same_path(storage_for(p)[1]) for p in [best_checkpoint, *(preserved_checkpoints or [])] if p}
    existing = list_checkpoints(model_dir)
    excess = len(existing) - max_checkpoints
    for path in existing:
        if excess <= 0:
            break
        if store.same_path(storage_for(path)[1]) in keep:
            continue
        _delete_checkpoint(path)
        excess -= 1


def _delete_checkpoint(path: str) -> None:
    store, root = storage_for(path)
    meta = get_checkpoint_metadata(path)
    if meta is not None:
        store.remove(store.join(root, meta.file_name))
    store.remove_tree(root)

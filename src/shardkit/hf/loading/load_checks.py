"""Checks a Hugging Face module load makes before any tensor of the module changes.

A module load reads tensors in place into the module's own parameters, so
whatever can be found wrong without reading tensor bytes is found here
first: names the checkpoint lacks (``strict``), shard files that are
missing, not regular, or whose header is malformed or holds other shapes.
Metadata only: no tensor byte is read, nothing is written.

Example::

    missing = refuse_missing(model_dir, module.state_dict(), ties, set(weight_map), strict=True)
"""

from __future__ import annotations

from typing import Dict, Set

from shardkit.errors import MissingShardError, TensorMismatchError
from shardkit.hf.index import files_to_names
from shardkit.hf.shard_io import indexed_entry, shard_header
from shardkit.hf.untrusted import require_regular_file
from shardkit.storage import storage_for

__all__ = ["check_shape", "check_shards", "covered_by", "refuse_missing", "require_shard"]


def require_shard(store, path: str, file_name: str, model_dir: str) -> None:
    """``MissingShardError`` if the shard the index names is absent; ``MetadataError`` if it is not a regular file."""
    if not store.exists(path):
        raise MissingShardError(
            f"the index names {file_name}, which is not in {model_dir}; the checkpoint is "
            f"incomplete (validate_checkpoint reports it) -- load an earlier one"
        )
    require_regular_file(store, path)


def refuse_missing(model_dir, own, own_ties, provided: Set[str], strict: bool) -> Set[str]:
    """The module's names the checkpoint does not provide (ties count); with ``strict``, raise if any."""
    missing = {k for k in own if k not in provided} - covered_by(own_ties, provided)
    if strict and missing:
        raise TensorMismatchError(
            f"the checkpoint in {model_dir} lacks tensors of the module: missing {sorted(missing)[:10]} "
            f"({len(missing)}). Load the right checkpoint, or pass strict=False to load what it has. "
            f"(Tensors the checkpoint has and the module lacks are never an error: a module may be one "
            f"shard of the model.)"
        )
    return missing


def check_shards(model_dir, weight_map, own, own_to_stored: Dict[str, str]) -> None:
    """Refuse, before the first tensor is read in place, a load that would stop part-way.

    Every file the load reads must be there and a regular file; each
    safetensors header is read and checked, and must hold the tensors the
    index places there, in the module's shapes. Metadata only: each header is
    read again by the load itself (headers are small); tensor bytes are not
    read, and a ``.bin`` is checked when it is read (before any in-place read,
    see :func:`shardkit.hf.loading.shard_reads.read_files`).
    """
    store, root = storage_for(model_dir)
    stored_to_own = {stored: name for name, stored in own_to_stored.items()}
    for file_name, in_file in files_to_names(weight_map, list(stored_to_own)).items():
        path = store.join(root, file_name)
        require_shard(store, path, file_name, model_dir)
        if file_name.endswith(".safetensors"):
            header = shard_header(store, path)
            for stored in in_file:
                name = stored_to_own[stored]
                check_shape(name, indexed_entry(header, path, stored).shape, own[name].shape)


def covered_by(own_ties, provided: Set[str]) -> Set[str]:
    """Names the module ties to a name the checkpoint provides (e.g. ``save_pretrained`` drops ``lm_head``)."""
    return {n for group in own_ties if any(m in provided for m in group) for n in group}


def check_shape(name: str, saved_shape, own_shape) -> None:
    if tuple(saved_shape) != tuple(own_shape):
        raise TensorMismatchError(
            f"tensor {name!r} has shape {list(saved_shape)} in the checkpoint, {list(own_shape)} "
            f"in the module; the checkpoint is for a different model configuration"
        )

"""Hugging Face–compatible sharded checkpoints and a managed directory of checkpoints.

The forgather ``sharded_checkpoint`` API (same names, parameters, defaults),
on shardkit storage: atomic files, index written last, hostile-input checks,
tied parameters stored once (``param_sharing``) and retied on load, ``.bin``
only through ``torch.load(weights_only=True)``. Files are the layout
``transformers`` and ``huggingface_hub`` read and write. Not here:
writing distributed (per-rank) checkpoints -- see ``shardkit.checkpoint``; this
package converts between the two (``distributed_to_hf``, ``hf_to_distributed``)
and its directory utilities recognise both.

Example::

    from shardkit.hf import save_checkpoint, load_checkpoint
    save_checkpoint("out/model", model, safetensors=True, max_shard_size=2**30)
    load_checkpoint("out/model", model)
"""

from shardkit.hf.convert import distributed_to_hf, hf_to_distributed
from shardkit.hf.directory import (
    CheckpointMeta,
    checkpoint_problems,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    list_checkpoints,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    validate_checkpoint,
)
from shardkit.hf.index import (
    ShardIndex,
    SharingMetadataT,
    StateDictLike,
    index_file_name,
    load_shard_index,
    make_shard_index,
    save_shard_index,
)
from shardkit.hf.links import create_pretrained_symlinks
from shardkit.hf.loading.load import load_checkpoint, load_sharded_checkpoint
from shardkit.hf.metrics import load_checkpoint_metrics, save_checkpoint_metrics
from shardkit.hf.saving.save import save_checkpoint, save_sharded_checkpoint
from shardkit.hf.sharing import create_sharing_metadata, retie_parameters

__all__ = [
    "CheckpointMeta",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "checkpoint_problems",
    "create_pretrained_symlinks",
    "create_sharing_metadata",
    "distributed_to_hf",
    "find_latest_checkpoint",
    "get_checkpoint_metadata",
    "hf_to_distributed",
    "index_file_name",
    "list_checkpoints",
    "load_checkpoint",
    "load_checkpoint_metrics",
    "load_shard_index",
    "load_sharded_checkpoint",
    "make_shard_index",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "retie_parameters",
    "save_checkpoint",
    "save_checkpoint_metrics",
    "save_shard_index",
    "save_sharded_checkpoint",
    "validate_checkpoint",
]

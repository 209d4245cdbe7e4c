"""Distributed checkpoints: every rank writes its shard; any world size loads them.

The training-loop API (shaped like ``torch.distributed.checkpoint``):
:func:`save`, :func:`load`, :func:`async_save` take DTensor / FSDP2 / TP
state dicts as they are (``checkpoint/api.py``). The lower-level contract (``docs/architecture.md``): :func:`save_distributed`,
:func:`load_distributed` (reshards when the world size differs),
:func:`reshard`, :func:`load_region`, :func:`load_consolidated`,
:func:`validate_distributed`, :func:`compute_shard_sizes`,
:func:`flat_shard_metadata`, the spec types, and the background
:class:`AsyncCheckpointer`. The on-disk format is ``docs/format.md``.

Example::

    from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed, load_distributed

    spec = ShardMetadata(4, {"w": TensorShardSpec((4096, 1024), 0, (1024,) * 4)})
    save_distributed({"w": my_slice, "step": 7}, "/ckpt/step-7", rank, 4, spec, group=pg)
    state = load_distributed("/ckpt/step-7", rank, 3)        # on 3 ranks
"""

from shardkit.checkpoint.loading.distributed_load import load_consolidated, load_distributed, load_region, read_metadata, reshard
from shardkit.checkpoint.loading.read_path import OpenCheckpoint, open_checkpoint
from shardkit.checkpoint.saving.distributed_save import save_distributed
from shardkit.checkpoint.format.spec import ShardMetadata, TensorShardSpec, flat_shard_metadata
from shardkit.checkpoint.loading.validate import ValidationReport, validate_distributed
from shardkit.layout import compute_shard_sizes
from shardkit.checkpoint.background.checkpointer import AsyncCheckpointer, AsyncWaitTimeout, CheckpointFuture
# ``save`` is the dcp-style function (``save_distributed`` lives in ``distributed_save.py``).
from shardkit.checkpoint.api import async_save, load, save
from shardkit.checkpoint.manager.checkpoint_manager import CheckpointManager

__all__ = [
    "open_checkpoint",
    "OpenCheckpoint",
    "save",
    "load",
    "async_save",
    "CheckpointManager",
    "TensorShardSpec",
    "ShardMetadata",
    "compute_shard_sizes",
    "flat_shard_metadata",
    "save_distributed",
    "load_distributed",
    "reshard",
    "load_region",
    "load_consolidated",
    "read_metadata",
    "validate_distributed",
    "ValidationReport",
    "AsyncCheckpointer",
    "CheckpointFuture",
    "AsyncWaitTimeout",
]

"""Read-only access to any checkpoint shardkit reads: shardkit distributed, Hugging Face, PyTorch DCP.

Sits beside :mod:`shardkit.hf` (it uses :mod:`shardkit.checkpoint`,
:mod:`shardkit.hf` and :mod:`shardkit.storage`) and below the CLI.
:func:`open_source` gives a :class:`CheckpointSource` that lists tensors
(``name -> TensorInfo(dtype, shape, checksum)``) and reads one at a time;
:class:`DcpCheckpoint` reads DCP checkpoints without unpickling anything
with plain pickle. Nothing here writes.

Example::

    from shardkit.sources import open_source

    with open_source("dcp_ckpt") as src:            # kind detected: "dcp"
        print({n: i.shape for n, i in src.tensors().items()})
"""

from shardkit.sources.base import KINDS, CheckpointSource, TensorInfo, detect_kind, open_source
from shardkit.sources.dcp import DcpCheckpoint, is_dcp_checkpoint
from shardkit.sources.dcp_metadata import read_dcp_metadata

__all__ = ["KINDS", "CheckpointSource", "TensorInfo", "detect_kind", "open_source", "DcpCheckpoint",
           "is_dcp_checkpoint", "read_dcp_metadata"]

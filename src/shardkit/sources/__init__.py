"""Read-only access to any checkpoint shardkit reads: shardkit distributed, Hugging Face, PyTorch DCP.

Sits beside :mod:`shardkit.hf` (it uses :mod:`shardkit.checkpoint`,
:mod:`shardkit.hf` and :mod:`shardkit.storage`) and below the CLI.
:func:`detect_kind` (``sources/detect.py``) is the one format detector every
reader asks; :func:`open_source` gives a :class:`CheckpointSource` (one
reader per format behind one interface) that lists tensors
(``name -> TensorInfo(dtype, shape, checksum)``), reads whole tensors or
boxes of them (``read_boxes``); :class:`DcpCheckpoint` reads DCP checkpoints
without unpickling anything with plain pickle. Nothing here writes.
:func:`complete_kind` says whether a directory is a complete checkpoint of a
kind ``checkpoint.load`` reads, and which, without reading tensor data.

Names load on first use (PEP 562): importing ``shardkit.sources.detect``
(the CLI's detection) imports no torch.

Example::

    from shardkit.sources import open_source

    with open_source("dcp_ckpt") as src:            # kind detected: "dcp"
        print({n: i.shape for n, i in src.tensors().items()})
"""

from shardkit.lazy_names import lazy_names

_HOMES = {
    "base": ["CheckpointSource", "TensorInfo", "open_source"],
    "detect": ["KINDS", "complete_kind", "detect_kind", "find_format", "format_problems"],
    "dcp": ["DcpCheckpoint", "is_dcp_checkpoint"],
    "dcp_metadata": ["read_dcp_metadata"],
}

__getattr__, __dir__, __all__ = lazy_names(__name__, globals(), _HOMES)

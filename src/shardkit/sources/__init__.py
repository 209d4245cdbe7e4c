"""Read-only access to any checkpoint shardkit reads: shardkit distributed, Hugging Face, PyTorch DCP.

Sits above :mod:`shardkit.hf` and the engine of :mod:`shardkit.checkpoint` (it reads through
them and :mod:`shardkit.storage`), below ``checkpoint.load`` and the CLI.
:func:`detect_kind` (``shardkit/format_detect.py``, below all readers) is the one format detector every
reader asks; :func:`open_source` gives a :class:`CheckpointSource` (one
reader per format behind one interface) that lists tensors
(``name -> TensorInfo(dtype, shape, checksum)``), reads whole tensors or
boxes of them (``read_boxes``); :class:`DcpCheckpoint` reads DCP checkpoints
without unpickling anything with plain pickle. Nothing here writes.
:func:`complete_kind` says whether a directory is a complete checkpoint of a
kind ``checkpoint.load`` reads, and which, without reading tensor data.

Names load on first use (PEP 562): importing ``shardkit.sources`` imports no torch until a
reader is asked for (the CLI's detection, ``shardkit.format_detect``, imports none).

Example::

    from shardkit.sources import open_source

    with open_source("dcp_ckpt") as src:            # kind detected: "dcp"
        print({n: i.shape for n, i in src.tensors().items()})
"""

from shardkit.lazy_names import lazy_names

_HOMES = {
    "base": ["CheckpointSource", "TensorInfo"],
    "opening": ["open_source"],
    "completeness": ["complete_kind", "format_problems"],
    "shardkit.format_detect": ["KINDS", "detect_kind", "find_format"],
    "dcp": ["DcpCheckpoint", "is_dcp_checkpoint"],
    "dcp_metadata": ["read_dcp_metadata"],
}

__getattr__, __dir__, __all__ = lazy_names(__name__, globals(), _HOMES)

"""``open_source``: the reader for the checkpoint in a directory, of the kind the one detector says.

Above every reader (``readers.py``, ``hf_source.py``) and below the callers (``checkpoint.load``, the
CLI, the offline tools). It opens; it reads nothing itself and never writes.

Example::

    with open_source("ckpt/step-100") as src:          # kind detected: "distributed", "hf" or "dcp"
        print(src.tensors())
"""

from __future__ import annotations

import logging

from shardkit.errors import MetadataError
from shardkit.format_detect import KINDS, detect_kind
from shardkit.sources.base import CheckpointSource
from shardkit.sources.hf_source import HFSource
from shardkit.sources.readers import DcpSource, DistributedSource

__all__ = ["open_source"]

log = logging.getLogger("shardkit.sources")


def open_source(path: str, kind: str | None = None, *, verify: bool | None = True) -> CheckpointSource:
    """Open the checkpoint in ``path`` for reading (``kind`` forces one of :data:`KINDS`; None: detect).

    ``verify`` (distributed checkpoints only): True hashes every block a read
    touches; None follows ``knobs.VERIFY_ON_LOAD`` (``checkpoint.load``'s choice).
    """
    kind = kind or detect_kind(path)
    if kind not in KINDS:
        raise MetadataError(f"unknown checkpoint kind {kind!r}; choose from {', '.join(KINDS)}")
    log.info("opening %s as a %s checkpoint", path, kind)
    if kind == "distributed":
        return DistributedSource(path, verify=verify)
    return {"hf": HFSource, "dcp": DcpSource}[kind](path)

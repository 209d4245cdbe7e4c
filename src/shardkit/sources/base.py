"""One read-only view of any checkpoint shardkit reads: names, dtypes, shapes, checksums, one tensor at a time.

:func:`open_source` recognises a shardkit distributed checkpoint
(``metadata.json``), a Hugging Face directory (``model.safetensors.index.json``,
``model.safetensors``, ``pytorch_model.bin[.index.json]``) and a PyTorch DCP
checkpoint (``.metadata``), and returns a :class:`CheckpointSource`:
``tensors()`` lists ``name -> TensorInfo(dtype, shape, checksum)`` without
reading tensor data, ``read(name)`` returns one whole tensor. It reuses the
existing readers (``load_region``, the HF shard readers, the DCP reader) and
never writes. ``checksum`` is a digest that is equal for two tensors only if
their bytes are (from a distributed checkpoint's block checksums); it is None
where the format records none (HF, DCP).

Example::

    with open_source("ckpt/step-100") as src:
        for name, info in src.tensors().items():
            print(name, info.dtype, info.shape)
        w = src.read("model.w")
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError

__all__ = ["TensorInfo", "CheckpointSource", "open_source", "detect_kind", "KINDS"]

log = logging.getLogger("shardkit.sources")
KINDS = ("distributed", "hf", "dcp")


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint says about one tensor, without reading it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class CheckpointSource:
    """A checkpoint opened for reading; also a context manager (``close`` releases open files)."""

    kind: str = ""

    def __init__(self, path: str):
        self.path = path

    def tensors(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, name: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> None:
        """Fill ``out`` (a contiguous CPU tensor of the saved dtype) with the box of tensor ``name`` at
        ``offsets`` (None: the origin) whose sizes are ``out.shape``; no temporary where the format allows.

        This base version reads the whole tensor and copies (whole boxes only); the kinds override it.
        """
        if offsets is not None and any(offsets):
            raise NotImplementedError(f"{self.kind} sources read whole tensors only")
        out.copy_(self.read(name))

    def objects(self) -> dict[str, Any]:
        """Plain (non-tensor) values by dotted name, where the format keeps them."""
        return {}

    def structure(self) -> Any:
        """The nesting of the saved state (a shardkit manifest's ``structure``), or None: flat names."""
        return None

    def user_metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint, where the format keeps it."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def detect_kind(path: str) -> str:
    """``"distributed"``, ``"hf"`` or ``"dcp"`` for the checkpoint in ``path``; raise when it is none of them."""
    from shardkit.hf.directory import get_checkpoint_metadata
    from shardkit.sources.dcp import is_dcp_checkpoint
    from shardkit.storage import storage_for

    if not os.path.exists(path) and "://" not in path:
        raise MissingShardError(f"{path} does not exist")
    if "://" not in path and not os.path.isdir(path):
        raise MetadataError(f"{path} is a file, not a checkpoint directory; pass the directory that holds it")
    storage, root = storage_for(path)
    if storage.exists(storage.join(root, "metadata.json")):
        return "distributed"  # first, as the CLI's checkpoint_kind decides: one answer per directory
    meta = get_checkpoint_metadata(path)
    if meta is not None:
        return "distributed" if meta.distributed else "hf"
    if is_dcp_checkpoint(path):
        return "dcp"
    if any(n.endswith(".distcp") for n in _listdir(path)):
        raise IncompleteCheckpointError(f"{path} has .distcp files but no .metadata: the DCP save never finished")
    if any(n.startswith("rank_") and n.endswith(".safetensors") for n in _listdir(path)):
        raise IncompleteCheckpointError(f"{path} has no metadata.json: the save never finished")
    raise MetadataError(
        f"{path} is not a checkpoint shardkit reads: no metadata.json (shardkit), model.safetensors[.index.json] "
        f"or pytorch_model.bin[.index.json] (Hugging Face), or .metadata (PyTorch DCP)")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def open_source(path: str, kind: str | None = None) -> CheckpointSource:
    """Open the checkpoint in ``path`` for reading (``kind`` forces one of :data:`KINDS`; None: detect)."""
    from shardkit.sources.readers import DcpSource, DistributedSource, HFSource

    kind = kind or detect_kind(path)
    if kind not in KINDS:
        raise MetadataError(f"unknown checkpoint kind {kind!r}; choose from {', '.join(KINDS)}")
    log.info("opening %s as a %s checkpoint", path, kind)
    return {"distributed": DistributedSource, "hf": HFSource, "dcp": DcpSource}[kind](path)

"""One read-only view of any checkpoint shardkit reads: names, dtypes, shapes, checksums, one tensor at a time.

:func:`~shardkit.sources.open_source` (``sources/opening.py``) recognises a shardkit distributed checkpoint
(``metadata.json``), a Hugging Face directory (``model.safetensors.index.json``,
``model.safetensors``, ``pytorch_model.bin[.index.json]``) and a PyTorch DCP
checkpoint (``.metadata``), and returns a :class:`CheckpointSource`:
``tensors()`` lists ``name -> TensorInfo(dtype, shape, checksum)`` without
reading tensor data, ``read(name)`` returns one whole tensor, ``read_boxes``
any boxes of any tensors (reading only their bytes where the format allows:
``checkpoint.load`` fills a rank's DTensor shards through it). The kind is
the one detector's (``format_detect.py``). It reuses the
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

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardkit.layout import Box

__all__ = ["TensorInfo", "CheckpointSource", "leaf_values"]


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
    #: Whether a box read as slabs of its rows reads the same bytes and checks as the box read whole (True
    #: where nothing is verified per record or block: Hugging Face). Where False, ``checkpoint.load`` reads a
    #: staged box whole: a slab edge inside a DCP record, or inside a checksum block, would skip that
    #: record's CRC check or re-read and re-hash the block.
    slab_reads: bool = False

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

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's global shape by name, reading as little as the format allows (no tensor data)."""
        return {n: tuple(i.shape) for n, i in self.tensors().items()}

    def dtype_of(self, name: str) -> torch.dtype:
        """The saved dtype of tensor ``name``."""
        return self.tensors()[name].dtype

    def aliases(self) -> dict[str, str]:
        """``{name: stored name}`` for tensors the checkpoint stores once under another name (tied weights:
        a Hugging Face checkpoint keeps ``model.embed_tokens.weight`` and drops ``lm_head.weight``)."""
        return {}

    def check_boxes(self, want: Mapping[str, Box]) -> None:
        """Check, reading no tensor data, what reading ``want`` relies on (file headers, sizes); raise the
        format's typed errors. A load calls it for every box before it reads one. Base: nothing to check."""

    def read_boxes(self, want: Mapping[str, Box], out: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        """Each ``name -> box`` of ``want`` as a CPU tensor of the saved dtype and the box's shape.

        ``out[name]`` (contiguous, CPU, the saved dtype, the box's shape) is
        read into where given; other boxes are allocated. Only the bytes of
        the boxes are read where the format allows (safetensors rows, DCP
        records). Never casts. This base version reads box by box through
        :meth:`read_into`.

        >>> src.read_boxes({"w": Box((4, 0), (4, 8))})["w"].shape
        torch.Size([4, 8])
        """
        result = {}
        for name, box in want.items():
            target = (out or {}).get(name)
            if target is None:
                target = torch.empty(box.sizes, dtype=self.dtype_of(name))
            self.read_into(name, target, box.offsets)
            result[name] = target
        return result

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


def leaf_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every non-empty list, tuple and dict split into dotted leaves (``betas.0``), as a
    nested state's leaves are named (a DCP keeps AdamW's ``betas`` tuple whole); an empty container
    stays a leaf. Example: ``leaf_values({"b": (0.9, 0.99)}) == {"b.0": 0.9, "b.1": 0.99}``."""
    out: dict[str, Any] = {}
    stack = list(reversed(list(values.items())))
    while stack:
        name, value = stack.pop()
        if isinstance(value, (list, tuple)) and value:
            stack.extend(reversed([(f"{name}.{i}", item) for i, item in enumerate(value)]))
        elif isinstance(value, dict) and value:
            stack.extend(reversed([(f"{name}.{key}", item) for key, item in value.items()]))
        else:
            out[name] = value
    return out

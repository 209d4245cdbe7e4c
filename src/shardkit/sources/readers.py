"""The three :class:`~shardkit.sources.base.CheckpointSource` kinds, each over an existing reader.

- :class:`DistributedSource`: ``checkpoint.read_metadata`` + ``load_region``
  (the whole box); checksums derived from the per-file block checksums;
- :class:`~shardkit.sources.hf_source.HFSource` (in ``hf_source.py``, importable from here too);
- :class:`DcpSource`: :class:`~shardkit.sources.dcp.DcpCheckpoint`.

None of them writes. Example: see :func:`shardkit.sources.open_source`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import torch
import xxhash

from shardkit.checkpoint.loading.execute import check_chunks
from shardkit.checkpoint.planning.plan import saved_chunks
from shardkit.checkpoint.loading.read_path import check_box, open_checkpoint
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import Box
from shardkit.sources.base import CheckpointSource, TensorInfo
from shardkit.sources.hf_source import HFSource

__all__ = ["DistributedSource", "HFSource", "DcpSource"]  # HFSource: from hf_source

log = logging.getLogger("shardkit.sources")


class DistributedSource(CheckpointSource):
    """A shardkit distributed checkpoint (``metadata.json``); incomplete ones are refused on open.

    ``verify=True`` (the default, for the CLI's converters): every block a read touches is hashed,
    so a corrupt source is refused, never copied under fresh checksums; None: ``knobs.VERIFY_ON_LOAD``.
    """

    kind = "distributed"

    def __init__(self, path: str, *, verify: bool | None = True):
        super().__init__(path)
        self._ck = open_checkpoint(path, verify=verify)
        self.manifest, self.storage, self.directory = self._ck.manifest, self._ck.storage, self._ck.directory
        self.records = self._ck.records
        self._infos: dict[str, TensorInfo] | None = None

    def tensors(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            self._infos = self._build_infos()
        return self._infos

    def _build_infos(self) -> dict[str, TensorInfo]:
        files = self._ck.files()   # the files the reads use: each opened and its header parsed once
        headers = {file_name: files.get(file_name)[1] for file_name in self.records}
        infos = {}
        for name, saved in self.manifest.tensors.items():
            dtype = self._ck.dtype(name)
            shape = tuple(saved.spec.full_shape)
            infos[name] = TensorInfo(dtype, shape, self._checksum(name, dtype, shape, saved_chunks(saved), headers))
        return infos

    def _checksum(self, name, dtype, shape, chunks, headers) -> str | None:
        """Equal for two tensors only when their bytes are: the block digests covering each chunk's range."""
        parts = [str(dtype), list(shape)]
        for file_name, box in chunks:
            record, header = self.records.get(file_name), headers.get(file_name)
            entry = header.tensors.get(name) if header is not None else None
            if record is None or entry is None or record.block_bytes <= 0:
                return None
            first, last = entry.begin // record.block_bytes, -(-entry.end // record.block_bytes)
            parts.append([list(box.offsets), entry.begin - first * record.block_bytes, entry.end - entry.begin,
                          record.block_checksums[first:last]])
        return "blocks:" + xxhash.xxh3_128_hexdigest(json.dumps(parts).encode())

    def read(self, name: str) -> torch.Tensor:
        saved = self.manifest.tensors.get(name)
        if saved is None:
            raise MetadataError(f"{self.path} has no tensor {name!r}")
        out = torch.empty(tuple(saved.spec.full_shape), dtype=self._dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> None:
        """Read the box at ``offsets`` of size ``out.shape`` straight into ``out``, every block verified.

        The data files are opened once per source (not per tensor) and every
        checksum block a read touches is hashed and compared with the record,
        so a corrupt source raises :class:`~shardkit.errors.ChecksumError`
        instead of being copied under fresh checksums.
        """
        saved = self.manifest.tensors.get(name)
        if saved is None:
            raise MetadataError(f"{self.path} has no tensor {name!r}")
        shape = tuple(saved.spec.full_shape)
        box = check_box(name, shape, offsets if offsets is not None else (0,) * len(shape), tuple(out.shape))
        self._ck.boxes({name: box}, out={name: out})

    def _dtype(self, name: str) -> torch.dtype:
        return self._ck.dtype(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.spec.full_shape) for n, t in self.manifest.tensors.items()}

    def dtype_of(self, name: str) -> torch.dtype:
        self._known(name)
        return self._ck.dtype(name)

    def check_boxes(self, want: Mapping[str, Box]) -> None:
        """Every file header holding a chunk that overlaps a box of ``want`` (name, dtype, chunk shape)."""
        for name in want:
            self._known(name)
        check_chunks(self._ck.files(), self.manifest.tensors, want, {n: self._ck.dtype(n) for n in want})

    def read_boxes(self, want: Mapping[str, Box], out: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        """The boxes through the checkpoint's planner: only the overlapping byte ranges, in parallel."""
        for name in want:
            self._known(name)
        return self._ck.boxes(dict(want), out={n: t for n, t in (out or {}).items() if n in want})

    def _known(self, name: str) -> None:
        if name not in self.manifest.tensors:
            raise TensorMismatchError(f"{self.path} has no tensor {name!r}; it holds "
                                      f"{', '.join(sorted(self.manifest.tensors)[:8]) or 'none'}")

    def close(self) -> None:
        self._ck.close()

    def objects(self) -> dict[str, Any]:
        return dict(self.manifest.objects)

    def structure(self) -> Any:
        return self.manifest.structure

    def user_metadata(self) -> dict[str, Any]:
        return dict(self.manifest.user_metadata)


class DcpSource(CheckpointSource):
    """A PyTorch DCP checkpoint (``.metadata`` + ``.distcp``), read without running its pickles' code."""

    kind = "dcp"

    def __init__(self, path: str):
        from shardkit.sources.dcp import DcpCheckpoint

        super().__init__(path)
        self.checkpoint = DcpCheckpoint(path)

    def tensors(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(t.dtype, t.shape) for n, t in self.checkpoint.tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.checkpoint.read(name)

    def dtype_of(self, name: str) -> torch.dtype:
        return self.checkpoint.tensors[name].dtype if name in self.checkpoint.tensors else super().dtype_of(name)

    def check_boxes(self, want: Mapping[str, Box]) -> None:
        """Every record a box of ``want`` reads lies inside its ``.distcp`` file (no tensor data read)."""
        for name, box in want.items():
            self.checkpoint.check_box_files(name, box.offsets, box.sizes)

    def read_into(self, name: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> None:
        self.checkpoint.read_into(name, out, offsets)

    def objects(self) -> dict[str, Any]:
        """The DCP's plain values (numbers, strings, bytes, and lists, tuples and string-keyed dicts of them).

        A damaged value raises (it is part of the checkpoint); one that is not
        plain data (a set, a dtype, a tuple holding a tensor) is left
        out, with a log line: :meth:`all_values` has those too.
        """
        out = {}
        for name, value in self.all_values().items():
            if _plain(value):
                out[name] = value
            else:
                log.info("skipping DCP value %s (a %s, not a plain value)", name, type(value).__name__)
        return out

    def all_values(self) -> dict[str, Any]:
        """Every non-tensor value as ``torch.load(weights_only=True)`` gives it, plain or not (for comparing,
        not for writing as JSON); one it refuses (damaged, or a pickled object) raises."""
        return {name: self.checkpoint.read_value(name) for name in self.checkpoint.values}

    def close(self) -> None:
        self.checkpoint.close()


def _plain(value, depth: int = 0) -> bool:
    """None, a bool, int, float, str or bytes, or a list, tuple or str-keyed dict of those (nested < 32 deep)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, bytearray)):
        return True
    if depth >= 32:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False

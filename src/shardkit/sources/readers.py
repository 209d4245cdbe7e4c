"""The three :class:`~shardkit.sources.base.CheckpointSource` kinds, each over an existing reader.

- :class:`DistributedSource`: ``checkpoint.read_metadata`` + ``load_region``
  (the whole box); checksums derived from the per-file block checksums;
- :class:`HFSource`: the index (or the single file's header) + ``hf.load_checkpoint(keys=...)``;
- :class:`DcpSource`: :class:`~shardkit.sources.dcp.DcpCheckpoint`.

None of them writes. Example: see :func:`shardkit.sources.open_source`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
import xxhash

from shardkit.checkpoint.plan import saved_chunks
from shardkit.checkpoint.read_path import check_box, open_checkpoint
from shardkit.dtypes import from_safetensors_name
from shardkit.errors import MetadataError
from shardkit.sources.base import CheckpointSource, TensorInfo
from shardkit.storage import storage_for

__all__ = ["DistributedSource", "HFSource", "DcpSource"]

log = logging.getLogger("shardkit.sources")


class DistributedSource(CheckpointSource):
    """A shardkit distributed checkpoint (``metadata.json``); incomplete ones are refused on open."""

    kind = "distributed"

    def __init__(self, path: str):
        super().__init__(path)
        # verify=True: every block a read touches is hashed, so a corrupt source is refused,
        # never copied under fresh checksums.
        self._ck = open_checkpoint(path, verify=True)
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

    def close(self) -> None:
        self._ck.close()

    def objects(self) -> dict[str, Any]:
        return dict(self.manifest.objects)

    def structure(self) -> Any:
        return self.manifest.structure

    def user_metadata(self) -> dict[str, Any]:
        return dict(self.manifest.user_metadata)


class HFSource(CheckpointSource):
    """A Hugging Face checkpoint directory (safetensors or ``.bin``, one file or an index)."""

    kind = "hf"

    def __init__(self, path: str):
        from shardkit.hf.directory import get_checkpoint_metadata
        from shardkit.hf.index import load_shard_index

        super().__init__(path)
        self.meta = get_checkpoint_metadata(path)
        if self.meta is None or self.meta.distributed:
            raise MetadataError(f"{path} holds no Hugging Face checkpoint")
        if self.meta.is_index:
            self.index = load_shard_index(path, self.meta.file_name)
        else:
            self.index = None
        self._infos: dict[str, TensorInfo] | None = None

    def tensors(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            self._infos = self._build_infos()
        return self._infos

    def _weight_map(self) -> dict[str, str]:
        if self.index is not None:
            return dict(self.index["weight_map"])
        return {"": self.meta.file_name}

    def _build_infos(self) -> dict[str, TensorInfo]:
        from shardkit.hf.bin_io import read_bin_shard
        from shardkit.hf.shard_io import shard_header

        store, root = storage_for(self.path)
        weight_map = self._weight_map()
        infos = {}
        for file_name in dict.fromkeys(weight_map.values()):
            path = store.join(root, file_name)
            if file_name.endswith(".safetensors"):
                found = {n: (from_safetensors_name(e.dtype), tuple(e.shape))
                         for n, e in shard_header(store, path).tensors.items()}
            else:  # a .bin has no header: load it (one file at a time) for dtypes and shapes
                found = {n: (t.dtype, tuple(t.shape)) for n, t in read_bin_shard(store, path).items()}
            wanted = [n for n, f in weight_map.items() if f == file_name] if self.index is not None else list(found)
            for n in wanted:
                if n not in found:
                    raise MetadataError(f"the index places {n!r} in {file_name}, which does not hold it; "
                                        f"the checkpoint in {self.path} is inconsistent")
                infos[n] = TensorInfo(*found[n])
        return infos

    def read(self, name: str) -> torch.Tensor:
        from shardkit.hf.load import load_checkpoint

        return load_checkpoint(self.path, keys={name})[name]

    def objects(self) -> dict[str, Any]:
        if self.index is None:
            return {}
        return dict((self.index.get("metadata") or {}).get("shardkit_objects") or {})


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

    def read_into(self, name: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> None:
        self.checkpoint.read_into(name, out, offsets)

    def objects(self) -> dict[str, Any]:
        """The DCP's plain values (numbers, strings, and lists, tuples and string-keyed dicts of them).

        A damaged value raises (it is part of the checkpoint); one that is not
        plain data (bytes, a set, a dtype, a tuple holding a tensor) is left
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
    """None, a bool, int, float or str, or a list, tuple or str-keyed dict of those (nested < 32 deep)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth >= 32:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False

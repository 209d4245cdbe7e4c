"""Read a PyTorch DCP (``torch.distributed.checkpoint``) checkpoint, tensor by tensor, running no code.

On disk (``FileSystemWriter``): ``.metadata`` (a pickle; read by
:func:`~shardkit.sources.dcp_metadata.read_dcp_metadata` through torch's
weights-only unpickler) and ``__<rank>_<n>.distcp`` files. Each saved chunk
of a tensor is one ``torch.save`` record (a small zip) at the byte range
``storage_data[MetadataIndex(fqn, chunk offsets)]`` gives (relative path,
offset, length); each non-tensor value is a ``torch.save``'d object there too.
Both are read with ``torch.load(weights_only=True)`` over just that byte
range, never with pickle (an ``io.BytesIO`` value is admitted, and read as
its bytes). A tensor saved in chunks (a sharded save on N ranks) is
assembled chunk by chunk, or only the chunks overlapping a box are read. A
chunk whose record is shorter than its data is refused on open, and a read
checks that its records lie inside their files before it allocates, so
memory is bounded by the bytes on disk. At most ``knobs.DCP_OPEN_FILES``
data files are held open. Not supported: DCP storage extensions
(compression transforms) and the Hugging Face storage writer's safetensors
layout; both are refused with a :class:`~shardkit.errors.MetadataError`.

Example::

    with DcpCheckpoint("/ckpt/dcp-step-100") as ck:
        w = ck.read("model.layers.0.w")                  # whole, from every chunk
        block = ck.read_box("model.layers.0.w", (0, 0), (8, 16))
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardkit import knobs
from shardkit.dtypes import itemsize_bytes
from shardkit.errors import ChecksumError, IncompleteCheckpointError, MetadataError, MissingShardError
from shardkit.layout import Box, cover_problem, intersect, whole_box
from shardkit.sources.dcp_metadata import chunk_boxes, int_tuple, read_dcp_metadata, storage_locations
from shardkit.sources.dcp_files import OpenReaders, RecordView
from shardkit.sources.dcp_record import check_record_crcs, crc32, tensor_data_span
from shardkit.storage import Reader, check_relative_name, storage_for
from shardkit.storage.safetensors_format.tensor_io import byte_view

__all__ = ["DcpChunk", "DcpTensor", "DcpCheckpoint", "is_dcp_checkpoint"]

log = logging.getLogger("shardkit.sources.dcp")


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk: its box in the full tensor and where its ``torch.save`` record is."""

    box: Box
    file_name: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


def is_dcp_checkpoint(dir) -> bool:
    """True when ``dir`` holds a DCP ``.metadata`` file (complete or not is for the reader to say)."""
    storage, directory = storage_for(dir)
    return storage.exists(storage.join(directory, ".metadata"))


class DcpCheckpoint:
    """An open DCP checkpoint directory: names, dtypes, shapes; tensors read one at a time.

    Reads ``.metadata`` once, holds up to ``knobs.DCP_OPEN_FILES`` data files
    open until :meth:`close` (also a context manager). Memory: one tensor (or
    one box) at a time; never more than its chunks' records hold on disk.
    """

    def __init__(self, dir):
        self.storage, self.directory = storage_for(dir)
        self.metadata = read_dcp_metadata(dir)
        self.tensors: dict[str, DcpTensor] = {}
        self.values: dict[str, DcpChunk] = {}
        self._files = OpenReaders(self._open_reader)
        self._spans: dict[DcpChunk, tuple[int, int] | None] = {}
        self._index()

    def _index(self) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        where = storage_locations(self.metadata, f"{self.directory}/.metadata")
        for fqn, entry in self.metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                what = f"{self.directory}/.metadata: tensor {fqn!r}"
                dtype = getattr(getattr(entry, "properties", None), "dtype", None)
                if not isinstance(dtype, torch.dtype):
                    raise MetadataError(f"{what} has dtype {dtype!r}, not a torch dtype; the metadata is corrupt")
                size = int_tuple(getattr(entry, "size", None), f"{what}: size")
                chunks = tuple(self._chunk(fqn, box, where) for box in chunk_boxes(entry, what))
                for chunk in chunks:
                    self._check_record_length(fqn, dtype, chunk)
                self._check_cover(fqn, size, chunks)
                self.tensors[fqn] = DcpTensor(dtype, size, chunks)
            elif isinstance(entry, BytesStorageMetadata):
                self.values[fqn] = self._chunk(fqn, None, where)
            else:
                raise MetadataError(f"{self.directory}/.metadata: entry {fqn!r} is a {type(entry).__name__}")

    def _check_cover(self, fqn: str, shape: tuple[int, ...], chunks: tuple[DcpChunk, ...]) -> None:
        """Refuse chunks that leave a gap, overlap, or leave the shape: a read would return unset bytes."""
        problem = cover_problem(shape, [c.box for c in chunks])
        if problem is not None:
            raise MetadataError(f"{self.directory}/.metadata: the chunks of {fqn!r} do not cover its shape "
                                f"{list(shape)} exactly, each element once: {problem}; the metadata is corrupt")

    def _check_record_length(self, fqn: str, dtype: torch.dtype, chunk: DcpChunk) -> None:
        """Refuse a chunk whose record is shorter than its data: a ``torch.save`` record never is, and the
        check bounds what a read allocates by the bytes on disk (a 16-byte record claiming 512 GiB)."""
        data_bytes = chunk.box.numel * itemsize_bytes(dtype)
        if chunk.length < data_bytes:
            raise MetadataError(
                f"{self.directory}/.metadata: tensor {fqn!r} (chunk at {list(chunk.box.offsets)}, sizes "
                f"{list(chunk.box.sizes)}, {dtype}) needs {data_bytes} bytes, but its record in {chunk.file_name} is "
                f"{chunk.length} bytes long; the metadata is corrupt or hostile. Restore it from a copy")

    def _chunk(self, fqn: str, box: Box | None, where: dict) -> DcpChunk:
        info = where.get((fqn, box.offsets if box is not None else None))
        if info is None:
            raise MetadataError(f"{self.directory}/.metadata lists {fqn!r} (chunk at {box and list(box.offsets)}) "
                                f"but its storage_data has no entry for it; the metadata is corrupt")
        if getattr(info, "transform_descriptors", None):
            raise MetadataError(f"{self.directory}: {fqn!r} is stored through DCP extensions "
                                f"{list(info.transform_descriptors)}; shardkit reads only untransformed DCP "
                                f"checkpoints (save without storage extensions)")
        file_name = check_relative_name(getattr(info, "relative_path", None), (".distcp",),
                                        source=f"{self.directory}/.metadata")
        offset, length = int_tuple((getattr(info, "offset", None), getattr(info, "length", None)),
                                   f"{self.directory}/.metadata: {fqn!r}'s offset and length")
        return DcpChunk(box, file_name, offset, length)

    # -- reading -----------------------------------------------------------------------------------

    def _open_reader(self, file_name: str) -> Reader:
        path = self.storage.join(self.directory, file_name)
        if not self.storage.exists(path):
            raise MissingShardError(f"{self.directory}: {file_name}, named by .metadata, is missing; "
                                    f"the DCP checkpoint is incomplete")
        return self.storage.open_reader(path)

    @staticmethod
    def _in_file(chunk: DcpChunk, reader: Reader) -> bool:
        return 0 <= chunk.offset and 0 <= chunk.length and chunk.offset + chunk.length <= reader.size_bytes

    def _check_in_file(self, chunk: DcpChunk, reader: Reader, what: str) -> None:
        if not self._in_file(chunk, reader):
            raise IncompleteCheckpointError(
                f"{self.directory}/{chunk.file_name} is {reader.size_bytes} bytes, but {what} is recorded at "
                f"{chunk.offset}..{chunk.offset + chunk.length}: the file is truncated")

    def _read_record(self, chunk: DcpChunk, what: str) -> bytes:
        with self._files.use(chunk.file_name) as reader:
            self._check_in_file(chunk, reader, what)
            record = reader.read(chunk.offset, chunk.length)
        self._check_crcs(record, chunk, what)
        return record

    def _load_record(self, chunk: DcpChunk, what: str, admit: Sequence[type] = ()) -> Any:
        """The object the record holds, by ``torch.load(weights_only=True)`` with ``admit`` allowed too."""
        record = self._read_record(chunk, what)
        try:
            with torch.serialization.safe_globals(list(admit)):
                return torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, AttributeError) as e:
            raise MetadataError(
                f"{self.directory}/{chunk.file_name}: {what} was refused by torch.load(weights_only=True): "
                f"it is corrupt or holds more than tensors and plain values ({type(e).__name__}: {str(e)[:200]})"
            ) from e

    def _load_chunk(self, name: str, chunk: DcpChunk) -> torch.Tensor:
        t = self._load_record(chunk, f"tensor {name!r} (chunk at {list(chunk.box.offsets)})")
        expected = self.tensors[name].dtype
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != chunk.box.sizes or t.dtype != expected:
            found = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise MetadataError(f"{self.directory}/{chunk.file_name}: chunk of {name!r} at {list(chunk.box.offsets)} "
                                f"holds {found}, .metadata says {expected} {list(chunk.box.sizes)}")
        return t

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (every chunk assembled)."""
        return self.read_box(name, *whole_box(self._tensor(name).shape))

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of tensor ``name``, reading only the chunks that overlap it."""
        meta = self._tensor(name)
        want = self._check_box(name, offsets, sizes)
        pieces = [c for c in meta.chunks if intersect(c.box, want) is not None]
        if len(pieces) == 1 and pieces[0].box == want and math.prod(want.sizes) > 0:
            return self._load_chunk(name, pieces[0])
        for chunk in pieces:  # before the allocation: it is then bounded by the bytes on disk
            with self._files.use(chunk.file_name) as reader:
                self._check_in_file(chunk, reader, f"tensor {name!r} (chunk at {list(chunk.box.offsets)})")
        out = torch.empty(want.sizes, dtype=meta.dtype)
        self.read_into(name, out, want.offsets)
        return out

    def read_into(self, name: str, out: torch.Tensor, offsets: Sequence[int] | None = None) -> None:
        """Fill ``out`` (contiguous CPU, the saved dtype) with the box at ``offsets`` of size ``out.shape``.

        A chunk saved as a plain tensor is copied straight from the file into
        ``out`` (:func:`~shardkit.sources.dcp_record.tensor_data_span`) when
        the part of it the box needs is one contiguous run both in the chunk
        and in ``out`` (a whole chunk, or whole rows of it: a reshard along
        dim 0); only that run's bytes are read. Any other chunk is read whole
        (through ``torch.load(weights_only=True)`` when its record is not a
        plain tensor) and the part copied. Verification (``knobs.DCP_VERIFY_CRC``):
        a record read whole is checked against its zip CRC-32s; a run read
        from a part of a record cannot be (the CRC covers the whole record),
        so a partly overlapping chunk is read unverified, as ``dcp.load``
        reads every chunk. Reading the whole record only to verify it cost a
        3-rank reshard of a 4-rank DCP half again the bytes of its share.
        """
        meta = self._tensor(name)
        if out.dtype != meta.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise MetadataError(f"reading {name!r} needs a contiguous CPU {meta.dtype} output, got {out.dtype}")
        want = self._check_box(name, offsets if offsets is not None else (0,) * len(meta.shape), tuple(out.shape))
        covered = 0
        for chunk in meta.chunks:
            overlap = intersect(chunk.box, want)
            if overlap is None:
                if chunk.box.numel == 0 and want == whole_box(meta.shape):
                    self._load_chunk(name, chunk)  # holds no element, but a whole read still checks its record
                continue
            dst = _region(out, want, overlap)
            if not (dst.is_contiguous() and self._read_in_place(name, chunk, dst, overlap)):
                src = self._chunk_tensor(name, chunk)
                dst.copy_(_region(src, chunk.box, overlap))
                del src
            covered += overlap.numel
        if covered != want.numel:
            raise MetadataError(f"{self.directory}: the chunks of {name!r} cover {covered} of the {want.numel} "
                                f"elements asked for; the checkpoint's .metadata is inconsistent")

    def _chunk_tensor(self, name: str, chunk: DcpChunk) -> torch.Tensor:
        """The whole chunk: its data bytes read straight into a fresh tensor when its record allows, else
        through ``torch.load``; checked to lie inside its file before anything is allocated."""
        what = f"tensor {name!r} (chunk at {list(chunk.box.offsets)})"
        with self._files.use(chunk.file_name) as reader:
            self._check_in_file(chunk, reader, what)
        out = torch.empty(chunk.box.sizes, dtype=self.tensors[name].dtype)
        return out if self._read_in_place(name, chunk, out) else self._load_chunk(name, chunk)

    def check_box_files(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        """Refuse, reading no tensor data, a box whose chunks' records are not inside their files (a
        truncated ``.distcp``: :class:`IncompleteCheckpointError`, a missing one: :class:`MissingShardError`)."""
        want = self._check_box(name, offsets, sizes)
        for chunk in self._tensor(name).chunks:
            if intersect(chunk.box, want) is not None:
                with self._files.use(chunk.file_name) as reader:
                    self._check_in_file(chunk, reader, f"tensor {name!r} (chunk at {list(chunk.box.offsets)})")

    def _check_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> Box:
        meta = self._tensor(name)
        want = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
        if len(want.sizes) != len(meta.shape) or len(want.offsets) != len(meta.shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(want.offsets, want.sizes, meta.shape)):
            raise MetadataError(f"box {list(want.offsets)}+{list(want.sizes)} does not fit {name!r} {list(meta.shape)}")
        return want

    def _read_in_place(self, name: str, chunk: DcpChunk, dst: torch.Tensor, part: Box | None = None) -> bool:
        """Copy the chunk's bytes (or those of ``part``, a box inside it) from the file into ``dst`` when its
        record allows and ``part``'s elements are one contiguous run of the chunk; False: read it another way.
        Only a whole chunk's bytes are checked against their CRC-32 (see :meth:`read_into`)."""
        if dst.numel() == 0:
            return True
        whole = part is None or part == chunk.box
        first = 0 if whole else _contiguous_run(chunk.box, part)
        if first is None:
            return False
        with self._files.use(chunk.file_name) as reader:
            if not self._in_file(chunk, reader):
                return False  # _load_record explains it
            span = self._span(name, chunk, reader)
            if span is None or span[0] + span[1] > chunk.length:
                return False
            reader.read_into(chunk.offset + span[0] + first * dst.element_size(), byte_view(dst))
        if whole and knobs.DCP_VERIFY_CRC and crc32(byte_view(dst)) != span[2]:
            raise self._corrupt(chunk, f"tensor {name!r} (chunk at {list(chunk.box.offsets)})")
        return True

    def _span(self, name: str, chunk: DcpChunk, reader: Reader) -> tuple[int, int, int] | None:
        """The chunk's :func:`~shardkit.sources.dcp_record.tensor_data_span`, parsed once per checkpoint."""
        if chunk not in self._spans:
            self._spans[chunk] = tensor_data_span(RecordView(reader, chunk.offset, chunk.length),
                                                  self.tensors[name].dtype, chunk.box.sizes)
        return self._spans[chunk]

    def _check_crcs(self, record: bytes, chunk: DcpChunk, what: str) -> None:
        if knobs.DCP_VERIFY_CRC and check_record_crcs(record) is not None:
            raise self._corrupt(chunk, what)

    def _corrupt(self, chunk: DcpChunk, what: str) -> ChecksumError:
        return ChecksumError(
            f"{self.directory}/{chunk.file_name}: the bytes of {what} at {chunk.offset}..{chunk.offset + chunk.length} "
            f"do not match the CRC-32 their record carries; the file is corrupt. Restore it from a copy, "
            f"or load an earlier checkpoint.")

    def read_value(self, name: str) -> Any:
        """The non-tensor value ``name`` (``torch.load(weights_only=True)``; refused if it is not plain data).

        An ``io.BytesIO`` leaf (DCP ``torch.save``s it like any value; the
        weights-only unpickler refused it, which made the whole checkpoint
        unreadable) comes back as its raw ``bytes``: data, comparable by value.
        """
        if name not in self.values:
            raise MetadataError(f"{self.directory} has no value {name!r}")
        value = self._load_record(self.values[name], f"value {name!r}", admit=(io.BytesIO,))
        return value.getvalue() if isinstance(value, io.BytesIO) else value

    def _tensor(self, name: str) -> DcpTensor:
        if name not in self.tensors:
            raise MetadataError(f"{self.directory} has no tensor {name!r}; it holds: "
                                f"{', '.join(sorted(self.tensors)[:8]) or 'none'}")
        return self.tensors[name]

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> "DcpCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _region(t: torch.Tensor, box: Box, part: Box) -> torch.Tensor:
    """The view of ``t`` (holding ``box`` of the full tensor) that holds ``part``."""
    for dim, (start, size, base) in enumerate(zip(part.offsets, part.sizes, box.offsets)):
        t = t.narrow(dim, start - base, size)
    return t


def _contiguous_run(box: Box, part: Box) -> int | None:
    """The first element of ``part`` within ``box``'s row-major elements when ``part``'s elements are one
    contiguous run there (whole trailing rows), else None. Example: rows 2..4 of a (6, 8) box -> 16."""
    view = _region(torch.empty(box.sizes, device="meta"), box, part)
    return view.storage_offset() if view.is_contiguous() else None

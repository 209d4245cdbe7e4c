"""Carry out a load plan: open each needed data file once, check it, read the planned bytes.

Direct pieces (contiguous in the file and in the output) are read straight
into the output tensors: no extra copy. The outputs are allocated here, or
given by the caller (``outputs``, to load into existing tensors). Other
pieces go through a scratch buffer of at most ``knobs.IO_CHUNK_BYTES`` and
are copied out with a strided view. Independent jobs run on the shared I/O
threads (``storage.run_parallel``, ``knobs.IO_THREADS`` of them). A rank's
extra memory is therefore a few scratch buffers, never a whole tensor or
file. This module does not decide what to read (``plan.py``).

Example::

    with OpenFiles(storage, directory, records, verify=True) as files:
        out = run_loads(files, plans, dtype_of)
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Callable, Mapping

import torch

from shardkit import knobs
from shardkit.dtypes import from_safetensors_name, to_safetensors_name
from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError, TensorMismatchError
from shardkit.checkpoint.format.manifest import Manifest, SavedTensor, file_records
from shardkit.checkpoint.format.references import Base, check_base, data_path, split_key
from shardkit.checkpoint.planning.plan import ChunkRead, TensorLoad, nonempty_chunk_files, overlapping_saved_chunks
from shardkit.layout import Box
from shardkit.storage import (
    FileRecord,
    Reader,
    SafetensorsHeader,
    Storage,
    byte_view,
    read_header,
    read_ranges,
    run_parallel,
)
from shardkit.storage.fast_io.destinations import check_disjoint
from shardkit.storage.fast_io.prefault import populate_for_write
from shardkit.storage.safetensors_format.tensor_io import ExtraReads, holds_of, map_verified

__all__ = ["OpenFiles", "run_loads", "check_chunks", "check_plans", "saved_dtype", "scratch_elems_of"]

#: Direct reads are cut into jobs of about this size so threads can share one big file.
_JOB_BYTES = 64 * 1024 * 1024


class OpenFiles:
    """Data files opened on demand, each checked once: size vs record, then its header."""

    def __init__(self, storage: Storage, directory: str, records: dict[str, FileRecord], *, verify: bool,
                 may_map: bool = False, bases: list[Base] = ()):
        self.storage, self.directory, self.records, self.verify = storage, directory, records, verify
        self.may_map = may_map  # run_loads may return outputs over maps of the files (see _mapped_outputs)
        self._open: dict[str, tuple[Reader, SafetensorsHeader]] = {}
        self._lock = threading.Lock()
        # Version 3: a base is proven to be the one referenced before the first of its files is opened.
        self._unchecked_bases = {b.dir: b for b in bases}
        self._base_dirs = frozenset(self._unchecked_bases)

    @classmethod
    def for_load(cls, storage: Storage, directory: str, m: Manifest, verify: bool | None) -> "OpenFiles":
        """The data files of checkpoint ``m``, checked against its records; ``verify=None`` means ``knobs.VERIFY_ON_LOAD``.

        Outputs may be mapped (zero-copy; verified like copies when ``verify``
        resolves to True) unless ``verify`` is True (explicitly asked for:
        private copies, every byte read and hashed).
        """
        may_map = verify is not True and knobs.MAP_LOADS
        verify = knobs.VERIFY_ON_LOAD if verify is None else bool(verify)
        return cls(storage, directory, file_records(storage, directory, m), verify=verify, may_map=may_map,
                   bases=m.bases)

    def get(self, file: str) -> tuple[Reader, SafetensorsHeader, FileRecord | None]:
        with self._lock:
            if file not in self._open:
                self._open[file] = self._open_one(file)
            reader, header = self._open[file]
        return reader, header, self.records.get(file) if self.verify else None

    def _open_one(self, file: str) -> tuple[Reader, SafetensorsHeader]:
        base_dir = split_key(file)[0]
        if base_dir in self._unchecked_bases:    # under self._lock: each base checked once
            check_base(self.storage, self.directory, self._unchecked_bases[base_dir])
            del self._unchecked_bases[base_dir]
        # Only a key naming one of the manifest's bases leaves the directory (an index's "sub/x" stays inside).
        path = (data_path(self.storage, self.directory, file) if base_dir in self._base_dirs
                else self.storage.join(self.directory, file))
        try:
            reader = self.storage.open_reader(path)
        except MissingShardError as e:
            raise MissingShardError(
                f"{path} is missing: the checkpoint names this data file but it is not there; the "
                f"save never finished or the file was deleted. Load an earlier checkpoint.") from e
        try:
            record = self.records.get(file)
            if record is not None and reader.size_bytes != record.bytes:
                raise IncompleteCheckpointError(
                    f"{path} is {reader.size_bytes} bytes, the manifest records {record.bytes}; the file "
                    f"is {'truncated' if reader.size_bytes < record.bytes else 'not the one saved'}")
            if record is not None and self.verify and record.header_checksum is None:
                _verify_header_bytes(reader, record)   # written before header checksums: through block 0
            return reader, read_header(reader, record if self.verify else None)   # else by its own checksum
        except BaseException:
            reader.close()
            raise

    def close(self) -> None:
        for reader, _ in self._open.values():
            reader.close()
        self._open.clear()

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _verify_header_bytes(reader: Reader, record: FileRecord) -> None:
    # The header steers every read: verify its bytes before trusting them. A
    # length beyond the file is left to read_header, which explains it.
    header_end = 8 + struct.unpack("<Q", reader.read(0, 8))[0] if reader.size_bytes >= 8 else 0
    if 8 <= header_end <= reader.size_bytes:
        read_ranges(reader, [(0, memoryview(bytearray(header_end)))], record)


def run_loads(files: OpenFiles, plans: list[TensorLoad], dtype_of: Callable[[str], torch.dtype],
              outputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Fill every planned output tensor; returns them by name.

    ``outputs`` (by name) are read into as they are, with no temporary: each
    must be a contiguous CPU tensor of the planned shape and dtype, none
    sharing memory with another (``TensorMismatchError``: the reads run in
    parallel). Every
    other output is allocated here. It does not check those tensors' values
    or convert anything; a wrong one raises :class:`TensorMismatchError`.

    >>> run_loads(files, plans, dtypes.__getitem__, {"w": model_w})["w"] is model_w
    """
    check_plans(files, plans, dtype_of)  # headers first: nothing is allocated for a shape no file holds
    given = outputs or {}
    check_disjoint({p.name: given[p.name] for p in plans if p.name in given}, "outputs")
    mapped = _mapped_outputs(files, [p for p in plans if p.name not in given], dtype_of)
    plans = [p for p in plans if p.name not in mapped]
    extra = ExtraReads.for_load(sum(math.prod(p.out_shape) * dtype_of(p.name).itemsize for p in plans))
    outputs = {**mapped, **{p.name: _output(p, dtype_of(p.name), given) for p in plans}}
    _prefault([outputs[p.name] for p in plans if p.name not in given])
    jobs: list[Callable[[], None]] = []
    direct: dict[str, list[tuple[int, memoryview]]] = {}
    for plan in plans:
        out = outputs[plan.name]
        for chunk in plan.reads:
            entry_begin = _check_entry(files, plan.name, chunk, out.dtype)
            itemsize = out.element_size()
            for piece in chunk.pieces:
                if piece.direct:
                    view = byte_view(out)[piece.dst_start * itemsize:(piece.dst_start + piece.src_numel) * itemsize]
                    direct.setdefault(chunk.file, []).append((entry_begin + piece.src_start * itemsize, view))
            scattered = [p for p in chunk.pieces if not p.direct]
            if scattered:
                jobs.append(lambda f=chunk.file, b=entry_begin, ps=scattered, o=out:
                            _read_scattered(files, f, b, ps, o, extra))
    for file, reads in direct.items():
        for batch in _batches(reads, _window_bytes(files.get(file)[2])):
            jobs.append(lambda f=file, rs=batch: _read_direct(files, f, rs, extra))
    run_parallel(jobs)
    return outputs


def _mapped_outputs(files: OpenFiles, plans: list[TensorLoad],
                    dtype_of: Callable[[str], torch.dtype]) -> dict[str, torch.Tensor]:
    """The outputs that are zero-copy loads, over private (copy-on-write) maps of the files, verified.

    Only where a plan's whole output is ONE contiguous byte range of one
    local file (the same-world-size load, a replicated tensor, a
    ``Shard(0)`` chunk) and the load may map (``files.may_map``). With
    ``files.verify``, every checksum block those ranges lie in is hashed from
    the maps before this returns (``storage.safetensors_format.tensor_io.map_verified``: a
    corrupt byte raises ``ChecksumError``); nothing is copied, pages come
    from the page cache, writes stay private. The others are left out: the
    caller allocates and reads them.
    """
    by_file: dict[str, list[tuple[TensorLoad, tuple[int, int]]]] = {}  # file -> (plan, (offset, nbytes))
    for plan in plans if files.may_map else []:
        found = _mapped_span(files, plan, dtype_of(plan.name))
        if found is not None:
            by_file.setdefault(found[0], []).append((plan, found[1]))
    outputs = {}
    for file, wanted in by_file.items():
        reader, header, record = files.get(file)
        views = map_verified(reader, [span for _, span in wanted], record, holds=holds_of(header))
        for (plan, _), view in zip(wanted, views):
            if view is not None:
                tensor = torch.frombuffer(view, dtype=dtype_of(plan.name), count=math.prod(plan.out_shape))
                outputs[plan.name] = tensor.view(plan.out_shape)
    return outputs


def _mapped_span(files: OpenFiles, plan: TensorLoad, dtype: torch.dtype) -> tuple[str, tuple[int, int]] | None:
    """``(file, (offset, nbytes))`` when ``plan``'s whole output is one contiguous, aligned byte range of one file."""
    if len(plan.reads) != 1 or len(plan.reads[0].pieces) != 1:
        return None
    chunk, piece = plan.reads[0], plan.reads[0].pieces[0]
    numel = math.prod(plan.out_shape)
    if not piece.direct or piece.dst_start != 0 or piece.src_numel != numel or numel == 0:
        return None
    offset = files.get(chunk.file)[1].tensors[plan.name].begin + piece.src_start * dtype.itemsize
    return None if offset % dtype.itemsize else (chunk.file, (offset, numel * dtype.itemsize))


def _prefault(fresh: list[torch.Tensor]) -> None:
    """Fault in the outputs allocated here before the reads fill them (``knobs.LOAD_PREFAULT``).

    Each of at least ``knobs.LOAD_PREFAULT_MIN_BYTES`` (smaller ones may be
    heap memory the allocator reuses, already faulted in) is faulted in
    with one ``MADV_POPULATE_WRITE`` per slice of ``_JOB_BYTES``, the slices
    spread over the I/O threads: on the 2-core VM a fresh 1 GiB copying load
    took 0.32 s with a trap per 4 KiB page and 0.22 s this way. No
    transparent huge pages are asked for: with the kernel's default
    ``defrag=madvise`` a huge-page fault compacts memory in line, and on that
    VM faulting 1 GiB took 0.09 s or 1.4-3.0 s, against 0.42-0.48 s in 4 KiB pages.
    """
    if not knobs.LOAD_PREFAULT:
        return
    slices = []
    for t in fresh:
        addr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        if nbytes < knobs.LOAD_PREFAULT_MIN_BYTES:
            continue
        slices += [(addr + start, min(_JOB_BYTES, nbytes - start)) for start in range(0, nbytes, _JOB_BYTES)]
    run_parallel([lambda a=a, n=n: populate_for_write(a, n) for a, n in slices])


def _output(plan: TensorLoad, dtype: torch.dtype, given: Mapping[str, torch.Tensor]) -> torch.Tensor:
    out = given.get(plan.name)
    if out is None:
        return torch.empty(plan.out_shape, dtype=dtype)
    found = (tuple(out.shape), out.dtype, out.device.type, out.is_contiguous())
    if found != (tuple(plan.out_shape), dtype, "cpu", True):
        raise TensorMismatchError(
            f"the output given for tensor {plan.name!r} is a {list(out.shape)} {out.dtype} tensor on "
            f"{out.device} (contiguous: {out.is_contiguous()}); reading straight into it needs a contiguous "
            f"CPU {list(plan.out_shape)} {dtype} tensor. Pass another tensor, or none to allocate one")
    return out.detach()  # the same memory; one that requires grad cannot be viewed as bytes


def check_chunks(files: OpenFiles, tensors: Mapping[str, SavedTensor], want: Mapping[str, Box],
                 dtypes: Mapping[str, torch.dtype]) -> None:
    """Check, before planning or allocating, every file header that holds a chunk overlapping a wanted box.

    Each such chunk must be in its file under the tensor's name with the
    chunk's shape and the saved dtype. Headers are checked against their
    files' sizes when parsed, so after this every shape that drives planning
    and allocation is one the files really hold: a claimed ``[2**50, 2]``
    raises here instead of planning billions of reads or allocating terabytes.
    """
    for name, box in want.items():
        for file, chunk, _ in overlapping_saved_chunks(tensors[name], box):
            _check_entry(files, name, ChunkRead(file, chunk.sizes, []), dtypes[name])


def check_plans(files: OpenFiles, plans: list[TensorLoad], dtype_of: Callable[[str], torch.dtype]) -> None:
    """Check every file header a plan reads from (name, dtype, chunk shape), reading no tensor bytes.

    ``run_loads`` does the same per call; this lets a caller that splits one
    load into several calls find a mismatched file before anything is written.
    """
    for plan in plans:
        for chunk in plan.reads:
            _check_entry(files, plan.name, chunk, dtype_of(plan.name))


def saved_dtype(files: OpenFiles, name: str, saved: SavedTensor) -> torch.dtype:
    """The saved dtype of tensor ``name``: from the manifest, else (seed format) from a file header."""
    if saved.dtype is not None:
        return from_safetensors_name(saved.dtype)
    # Seed format: the dtype lives only in the headers (F32 or F64).
    for file in nonempty_chunk_files(saved):
        entry = files.get(file)[1].tensors.get(name)
        if entry is not None:
            return from_safetensors_name(entry.dtype)
    raise MetadataError(f"no data file holds tensor {name!r}, which metadata.json describes")


def scratch_elems_of(dtypes: Mapping[str, torch.dtype]) -> Callable[[str], int]:
    """The scratch size, in elements of each tensor, that ``plan_load`` may use per read job."""
    # IO_CHUNK_BYTES bounds the scratch of all reading threads together, not each.
    scratch_bytes = knobs.IO_CHUNK_BYTES // max(1, knobs.IO_THREADS)
    return lambda name: max(1, scratch_bytes // dtypes[name].itemsize)


def _check_entry(files: OpenFiles, name: str, chunk: ChunkRead, dtype: torch.dtype) -> int:
    _, header, _ = files.get(chunk.file)
    entry = header.tensors.get(name)
    if entry is None:
        raise MetadataError(f"{chunk.file} has no tensor {name!r}, but the checkpoint metadata places a "
                            f"chunk of it there; the file does not belong to this checkpoint")
    if from_safetensors_name(entry.dtype) != dtype:
        raise TensorMismatchError(f"tensor {name!r} in {chunk.file} is {entry.dtype}, the metadata says "
                                  f"{to_safetensors_name(dtype)}; the file does not belong to this checkpoint")
    if tuple(entry.shape) != tuple(chunk.chunk_shape):
        raise TensorMismatchError(f"tensor {name!r} in {chunk.file} has shape {list(entry.shape)}, the "
                                  f"metadata gives this chunk {list(chunk.chunk_shape)}")
    return entry.begin


def _window_bytes(record: FileRecord | None) -> int:
    """The file window one read job covers: ``_JOB_BYTES`` rounded up to whole checksum blocks of ``record``."""
    if record is None:
        return _JOB_BYTES
    return -(-_JOB_BYTES // record.block_bytes) * record.block_bytes


def _batches(reads: list[tuple[int, memoryview]], window_bytes: int):
    """Group direct reads into jobs by the ``window_bytes`` window of the file they fall in (big ones cut at
    window edges), for the threads.

    Windows start at file offsets that are multiples of ``window_bytes``, a
    whole number of checksum blocks (``_window_bytes``): no verified block is
    shared by two jobs. A shared block would be read and hashed by both
    locally, and on an object store each job would see it only in part and
    read it unverified.
    """
    windows: dict[int, list[tuple[int, memoryview]]] = {}
    for offset, view in reads:
        cuts = range(window_bytes - offset % window_bytes, len(view), window_bytes)
        for start, stop in zip([0, *cuts], [*cuts, len(view)]):
            windows.setdefault((offset + start) // window_bytes, []).append((offset + start, view[start:stop]))
    return [windows[w] for w in sorted(windows)]


def _read_direct(files: OpenFiles, file: str, reads: list[tuple[int, memoryview]], extra: ExtraReads) -> None:
    reader, header, record = files.get(file)
    read_ranges(reader, reads, record, holds=holds_of(header), extra=extra)


def _read_scattered(files: OpenFiles, file: str, entry_begin: int, pieces, out: torch.Tensor,
                    extra: ExtraReads) -> None:
    reader, header, record = files.get(file)
    itemsize = out.element_size()
    # One scratch buffer per job, reused: fewer allocations for the allocator to hold on to.
    buffer = torch.empty(max(p.src_numel for p in pieces), dtype=out.dtype)
    for piece in pieces:
        scratch = buffer[: piece.src_numel]
        read_ranges(reader, [(entry_begin + piece.src_start * itemsize, byte_view(scratch))], record,
                    holds=holds_of(header), extra=extra)
        target = out.as_strided(piece.sizes, piece.dst_strides, out.storage_offset() + piece.dst_start)
        target.copy_(scratch.as_strided(piece.sizes, piece.src_strides, 0))



"""Write a safetensors file fast, atomically, with block checksums.

The tensors' own memory goes to the file, no serialised copy of the state.
On local storage a durable file is written with ``O_DIRECT`` through aligned
bounce buffers (``storage.fast_io.direct_io``), a few large writes in flight; where
the file system refuses that, or for ``durable=False``, ``knobs.WRITE_THREADS``
threads write positionally into the page cache, each chunk's writeback
started as soon as it is written; other stores get one sequential stream.
Hashing runs on its own thread, in file order, beside the writes. The
recorded checksums are those of the bytes handed to the file: on the direct
path the bounce buffers' bytes are hashed too, and a block that differs from
the tensors' own bytes (memory changed between the copy and the write) fails
the save with ``ChecksumError`` before the file is published. Tensors
may be given lazily (:class:`LazyTensor`), so a converter holds about one
tensor at a time. This module does not decide which tensors go to which file.

Example::

    record = write_safetensors(store, path, [("w", w), ("b", b)], {"format": "pt"})
    record.checksum        # 'xxh3_64_blocks:...'
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Union

import torch

from shardkit import knobs
from shardkit.dtypes import itemsize_bytes, to_safetensors_name
from shardkit.errors import ChecksumError
from shardkit.storage.backends.base import Storage
from shardkit.storage.checksum import BlockHasher, FileRecord, block_digest
from shardkit.storage.safetensors_format.header import file_layout
from shardkit.storage.safetensors_format.tensor_io import byte_view

__all__ = ["LazyTensor", "TensorLike", "write_safetensors"]


@dataclass(frozen=True)
class LazyTensor:
    """A tensor described now and produced (``load()``) only when it is written."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize_bytes(self.dtype)


TensorLike = Union[torch.Tensor, LazyTensor]


def _materialise(t: TensorLike) -> torch.Tensor:
    t = (t.load() if isinstance(t, LazyTensor) else t).detach()
    # a conjugate or negative view keeps its sign in a bit, not in its bytes: resolve it first
    return (t.cpu() if t.device.type != "cpu" else t).resolve_conj().resolve_neg().contiguous()


def _ready_as_is(t: TensorLike) -> bool:
    """Whether ``_materialise(t)`` has nothing to do: a contiguous CPU tensor, no loader, no copy."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def write_safetensors(
    storage: Storage,
    path: str,
    named_tensors: list[tuple[str, TensorLike]],
    metadata: dict[str, str] | None = None,
    *,
    checksum: bool = True,
    durable: bool = True,
    mode=None,
) -> FileRecord | None:
    """Write ``named_tensors`` as one safetensors file at ``path``, atomically; return its record.

    Tensors are laid out as ``file_layout`` gives (widest dtype first, then
    by name, so each starts aligned to its element size): the byte ranges can
    be computed without reading the file back. Non-contiguous, GPU and lazy tensors are
    made ready one at a time; a lazy tensor's bytes are written (and hashed)
    before the next one is produced, so memory holds about one of them.
    ``checksum=False`` skips the block hashes (for formats with nowhere to
    keep them, e.g. Hugging Face shards) and returns None. ``durable=False``
    skips early writeback and fsync (see ``Storage.atomic_writer``); ``mode`` (a
    ``fast_io.write_mode.WriteMode``; None: a blocking save's) says how a local durable write treats
    the machine: past the page cache or through it, and at what pace (``Storage.open_sink``). The record carries the header's
    own checksum (``FileRecord.header_checksum``), so a reader checks the header without the first block.
    """
    layout = file_layout([(name, to_safetensors_name(t.dtype), tuple(t.shape)) for name, t in named_tensors],
                         metadata)
    order = [named_tensors[i] for i in layout.order]
    # Nothing to prepare between pieces (no lazy, device or strided tensor): the caller would only
    # wait for a writer thread, so the sink may write in the caller's thread.
    inline = all(_ready_as_is(t) for _, t in named_tensors)
    with storage.atomic_writer(path, durable) as f:
        sink = storage.open_sink(f, durable, checksum, size_bytes=layout.size_bytes, inline=inline,
                                 mode=mode)
        if getattr(sink, "hashes_source", False) or (not checksum and hasattr(sink, "write_many")):
            record = _write_in_one_pass(path, sink, layout.header, order, checksum)
        else:
            record = _write_pieces(path, sink, layout, order, checksum)
    return None if record is None else replace(record, header_checksum=block_digest(layout.header))


def _write_in_one_pass(path: str, sink, header: bytes, order: list[tuple[str, TensorLike]],
                       checksum: bool) -> FileRecord | None:
    """Hand a sink that copies and hashes by itself (``storage.fast_io.direct_io``) the whole file in as few
    calls as there are lazy tensors plus one: each run of ready tensors is one ``write_many`` (one C
    call, the GIL released throughout); a lazy or strided tensor is made ready alone, then written."""
    try:
        run: list[memoryview] = [memoryview(header)]
        for _, t in order:
            if _ready_as_is(t):
                run.append(byte_view(t))
                continue
            sink.write_many(run)
            run = [byte_view(_materialise(t))]
            sink.write_many(run)  # copied when it returns: the tensor may go before the next is produced
            run = []
        sink.write_many(run)
    finally:
        sink.close()
    return _record_of_written(path, sink.source_record(), sink.hasher) if checksum else None


def _write_pieces(path: str, sink, layout, order: list[tuple[str, TensorLike]], checksum: bool) -> FileRecord | None:
    """Hand ``sink`` the file piece by piece, hashing the pieces on a thread of their own (in file order)."""
    header = layout.header
    hasher = BlockHasher(knobs.CHECKSUM_BLOCK_BYTES) if checksum else None
    small = layout.size_bytes < knobs.SMALL_FILE_BYTES
    # One hashing worker keeps the updates in file order; a small file is hashed inline.
    with _InlineCalls() if small else ThreadPoolExecutor(1, thread_name_prefix="shardkit-hash") as hashing:
        step = getattr(sink, "piece_bytes", None) or knobs.IO_CHUNK_BYTES
        try:
            for view, lazy in _views(header, order):
                for start in range(0, len(view), step):
                    piece = view[start : start + step]
                    if hasher is not None:
                        hashing.submit(hasher.update, piece)
                    sink.write(piece)
                if lazy:  # let it go before the next one is produced
                    sink.drain()
                    hashing.submit(lambda: None).result()
        finally:
            sink.close()
        if hasher is None:
            return None
        # Called inside the atomic writer's block: a mismatch must not publish the file.
        return _record_of_written(path, hashing.submit(hasher.finish).result(), sink.hasher)


def _record_of_written(path: str, source: FileRecord, written_hasher: BlockHasher | None) -> FileRecord:
    """The record of the bytes written, after checking them block by block against the source's."""
    if written_hasher is None:
        return source  # the sink wrote straight from the tensors' memory
    written = written_hasher.finish()
    if written.block_checksums != source.block_checksums or written.bytes != source.bytes:
        block = next((i for i, (a, b) in enumerate(zip(written.block_checksums, source.block_checksums)) if a != b),
                     min(len(written.block_checksums), len(source.block_checksums)))
        start = block * source.block_bytes
        raise ChecksumError(
            f"{path}: the bytes written to disk differ from the tensors' bytes at {start}..."
            f"{start + source.block_bytes} (block {block}; {written.bytes} bytes written, {source.bytes} "
            f"expected): memory changed between the copy into the write buffers and the write (another "
            f"process writing through the same buffers, or a tensor modified during the save). Nothing "
            f"was published under that name and the file there before is untouched; save again, and "
            f"report a bug if it repeats")
    return written


def _views(header: bytes, order: list[tuple[str, TensorLike]]):
    yield memoryview(header), False
    for _, t in order:
        yield byte_view(_materialise(t)), isinstance(t, LazyTensor)


class _InlineCalls:
    """An executor whose ``submit`` runs the call at once, in order: a small file is not worth a thread."""

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future, as a pool would
            done.set_exception(e)
        return done

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

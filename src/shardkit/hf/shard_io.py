"""One safetensors shard: read chosen tensors straight into place.

Reading opens only the file asked for, checks its header, and fills
caller-owned tensors in parallel; mapping gives tensors over a
copy-on-write memory map instead (nothing read until touched). Writing a shard is
:func:`shardkit.storage.write_safetensors`. This module does not decide
which tensors go to which file.

Example::

    out = {"w": torch.empty_like(w)}
    read_shard_into(store, path, out)
"""

from __future__ import annotations

import torch

from shardkit import knobs
from shardkit.dtypes import from_safetensors_name, itemsize_bytes, to_safetensors_name
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.hf.untrusted import hostile_input, require_regular_file
from shardkit.storage import BufferReader, Storage, byte_view, read_header, read_ranges, run_parallel
from shardkit.storage.fast_io.destinations import check_disjoint
from shardkit.storage.fast_io.map_prefetch import prefetch_mapped

__all__ = ["indexed_entry", "map_shard", "read_shard", "read_shard_into", "shard_header"]


_FIX = "the shard is corrupt, truncated or not safetensors; restore it or load an earlier checkpoint"


def shard_header(storage: Storage, path: str):
    """The checked header of the safetensors file at ``path``.

    ``MissingShardError`` if it is absent; ``MetadataError`` if it is not a
    regular file (checked before opening: a FIFO would block) or its header
    is malformed.
    """
    require_regular_file(storage, path)
    with storage.open_reader(path) as reader:
        return _checked_header(reader, path)


def _checked_header(reader, path: str):
    # read_header types what it checks; a value of an unexpected JSON type can
    # still slip past it as a TypeError (e.g. a list as dtype), typed here.
    with hostile_input(path, fix=_FIX):
        return read_header(reader)


def read_shard_into(storage: Storage, path: str, targets: dict[str, torch.Tensor]) -> None:
    """Fill each CPU, contiguous tensor in ``targets`` with the tensor of that name in ``path``.

    Shapes and dtypes must match exactly, and no two targets may share memory
    (``TensorMismatchError`` otherwise: the reads run in parallel);
    a name missing from the file raises ``MetadataError``. Reads only the
    bytes of the named tensors.
    """
    read_shard(storage, path, list(targets), lambda name, entry: targets[name])


def read_shard(storage: Storage, path: str, names: list[str], buffer_for) -> dict[str, torch.Tensor]:
    """Read ``names`` from ``path`` into ``buffer_for(name, header_entry)``; return the buffers.

    Opens the file once: header checked, then the tensors' bytes only.
    """
    require_regular_file(storage, path)
    with storage.open_reader(path) as reader:
        header = _checked_header(reader, path)
        buffers, reads = {}, []
        for name in names:
            entry = indexed_entry(header, path, name)
            out = buffers[name] = buffer_for(name, entry)
            _check_entry(path, name, entry, out)
            reads.append((entry.begin, byte_view(out)))
        check_disjoint(buffers, f"{path}: buffers for")
        _read_parallel(reader, reads)
    return buffers


def map_shard(storage: Storage, path: str, names: list[str]) -> dict[str, torch.Tensor] | None:
    """``names`` from ``path`` as tensors over a copy-on-write map of the file; None if it cannot be mapped.

    Nothing is read now: pages come from the page cache (or disk) when the
    tensors are first touched, or earlier from a background thread that maps
    the named tensors' pages ahead of use (``storage.fast_io.map_prefetch``;
    ``knobs.MAP_PREFETCH``), and memory is shared with the page cache until
    a tensor is written to (writes stay private, never reaching the file).
    The header is checked as in :func:`read_shard`, read from the map itself. A tensor whose offset is
    not a multiple of its element size, or an empty one, is read into fresh
    memory instead. The file must not be truncated or rewritten in place
    while the tensors live (shardkit and transformers replace files whole);
    returns None for storage that cannot map (remote URLs).
    """
    require_regular_file(storage, path)
    mapping = storage.map_private(path)
    if mapping is None:
        return None
    with BufferReader(path, mapping) as in_memory:  # the header from the map: the file is opened once
        header = _checked_header(in_memory, path)
    out, copies, spans = {}, [], []
    for name in names:
        entry = indexed_entry(header, path, name)
        dtype = from_safetensors_name(entry.dtype)
        itemsize = itemsize_bytes(dtype)
        numel = (entry.end - entry.begin) // itemsize
        if numel == 0 or entry.begin % itemsize:
            copies.append(name)
            continue
        flat = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=entry.begin)
        out[name] = flat.view(tuple(entry.shape))
        spans.append((entry.begin, entry.end - entry.begin))
    prefetch_mapped(mapping, spans)  # pages mapped in the background, ahead of first touch
    if copies:
        out.update(read_shard(storage, path, copies, lambda _n, e: torch.empty(e.shape, dtype=from_safetensors_name(e.dtype))))
    return out


def indexed_entry(header, path: str, name: str):
    """The header entry of ``name``, which the index places in ``path``; ``MetadataError`` if the file lacks it."""
    entry = header.tensors.get(name)
    if entry is None:
        raise MetadataError(
            f"the index places {name!r} in {path}, but that file has no such tensor "
            f"(it has {len(header.tensors)} others); the index and shards do not match"
        )
    return entry


def _check_entry(path: str, name: str, entry, out: torch.Tensor) -> None:
    found = (to_safetensors_name(out.dtype), tuple(out.shape))
    if (entry.dtype, tuple(entry.shape)) != found:
        raise TensorMismatchError(
            f"{path}: tensor {name!r} is {entry.dtype} {list(entry.shape)} in the file, the "
            f"destination is {found[0]} {list(found[1])}; load into a matching model, or use "
            f"module=None to get the tensors as saved"
        )


def _read_parallel(reader, reads: list[tuple[int, memoryview]]) -> None:
    step = knobs.IO_CHUNK_BYTES
    pieces = [(off + s, view[s : s + step]) for off, view in reads for s in range(0, len(view), step)]
    run_parallel([lambda p=p: read_ranges(reader, [p]) for p in pieces])

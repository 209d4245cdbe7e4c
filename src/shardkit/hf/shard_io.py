"""One safetensors shard: write it fast and atomically, read chosen tensors straight into place.

Writing builds the header with :func:`shardkit.storage.build_header`, then, on
local storage, writes the tensors' own memory with positional writes from
``knobs.IO_THREADS`` threads while a helper thread keeps the kernel writing
back (so the final fsync has little left); the file is published by
``Storage.atomic_writer`` (whole or not at all). Tensors may be given lazily
(a callable), so a converter holds one tensor at a time. Reading opens only
the file asked for, checks its header, and fills caller-owned tensors in
parallel. This module does not decide which tensors go to which file.

Example::

    write_shard(store, path, [("w", w)], {"format": "pt"})
    out = {"w": torch.empty_like(w)}
    read_shard_into(store, path, out)
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Union

import torch

from shardkit import knobs
from shardkit.dtypes import to_safetensors_name
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.storage import LocalStorage, Storage, build_header, byte_view, read_header, read_ranges

__all__ = ["LazyTensor", "write_shard", "read_shard", "read_shard_into", "shard_header"]


@dataclass(frozen=True)
class LazyTensor:
    """A tensor described now and produced only when it is written (one at a time)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


TensorLike = Union[torch.Tensor, LazyTensor]


def _nbytes(t: TensorLike) -> int:
    return t.nbytes if isinstance(t, LazyTensor) else t.numel() * t.element_size()


def _element_size(t: TensorLike) -> int:
    return torch.empty((), dtype=t.dtype).element_size()


def _materialise(t: TensorLike) -> torch.Tensor:
    t = t.load() if isinstance(t, LazyTensor) else t
    t = t.detach()
    return (t.cpu() if t.device.type != "cpu" else t).contiguous()


def write_shard(storage: Storage, path: str, named: list[tuple[str, TensorLike]], metadata: dict[str, str]) -> None:
    """Write ``named`` tensors as one safetensors file at ``path``, atomically.

    Layout matches ``write_safetensors``: widest dtype first, then by name.
    Does not record checksums (the Hugging Face format has no place for them).
    """
    order = sorted(named, key=lambda nt: (-_element_size(nt[1]), nt[0]))
    entries = [(n, to_safetensors_name(t.dtype), tuple(t.shape), _nbytes(t)) for n, t in order]
    header = build_header(entries, metadata)
    with storage.atomic_writer(path) as f:
        if isinstance(storage, LocalStorage):
            _write_local(f.fileno(), header, order)
        else:
            f.write(header)
            for _, t in order:
                f.write(byte_view(_materialise(t)))


def _write_local(fd: int, header: bytes, order: list[tuple[str, TensorLike]]) -> None:
    stop = threading.Event()
    nudger = threading.Thread(target=_keep_writing_back, args=(fd, stop), daemon=True)
    nudger.start()
    try:
        _pwrite_all(fd, memoryview(header), 0)
        offset = len(header)
        with ThreadPoolExecutor(max(1, knobs.IO_THREADS)) as pool:
            for _, t in order:
                tensor = _materialise(t)
                view = byte_view(tensor)
                step = knobs.IO_CHUNK_BYTES
                jobs = [pool.submit(_pwrite_all, fd, view[s : s + step], offset + s) for s in range(0, len(view), step)]
                for job in jobs:
                    job.result()
                offset += len(view)
    finally:
        stop.set()
        nudger.join()


def _keep_writing_back(fd: int, stop: threading.Event) -> None:
    # Start write-back while we are still copying, so the publishing fsync is short.
    while not stop.wait(0.05):
        try:
            os.fdatasync(fd)
        except OSError:
            return


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def shard_header(storage: Storage, path: str):
    """The checked header of the safetensors file at ``path``."""
    with storage.open_reader(path) as reader:
        return read_header(reader)


def read_shard_into(storage: Storage, path: str, targets: dict[str, torch.Tensor]) -> None:
    """Fill each CPU, contiguous tensor in ``targets`` with the tensor of that name in ``path``.

    Shapes and dtypes must match exactly (``TensorMismatchError`` otherwise);
    a name missing from the file raises ``MetadataError``. Reads only the
    bytes of the named tensors.
    """
    read_shard(storage, path, list(targets), lambda name, entry: targets[name])


def read_shard(storage: Storage, path: str, names: list[str], buffer_for) -> dict[str, torch.Tensor]:
    """Read ``names`` from ``path`` into ``buffer_for(name, header_entry)``; return the buffers.

    Opens the file once: header checked, then the tensors' bytes only.
    """
    with storage.open_reader(path) as reader:
        header = read_header(reader)
        buffers, reads = {}, []
        for name in names:
            entry = header.tensors.get(name)
            if entry is None:
                raise MetadataError(
                    f"the index places {name!r} in {path}, but that file has no such tensor "
                    f"(it has {len(header.tensors)} others); the index and shards do not match"
                )
            out = buffers[name] = buffer_for(name, entry)
            _check_entry(path, name, entry, out)
            reads.append((entry.begin, byte_view(out)))
        _read_parallel(reader, reads)
    return buffers


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
    if len(pieces) <= 1 or knobs.IO_THREADS <= 1:
        read_ranges(reader, pieces)
        return
    with ThreadPoolExecutor(knobs.IO_THREADS) as pool:
        for job in [pool.submit(read_ranges, reader, [p]) for p in pieces]:
            job.result()

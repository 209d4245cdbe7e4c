"""Staging: copy a state's tensor leaves into reusable CPU buffers, fast.

Used by :class:`~shardkit.checkpoint.async_save.AsyncCheckpointer` on the
caller's thread, so this is the part of a background save the caller waits
for. Host tensors are copied in chunks on a few threads (non-temporal
stores where ``storage.memcopy`` has them, else ``memmove``); CUDA
tensors go to pinned buffers with non-blocking copies and one synchronize
per device. It writes no file and issues no collective.

Example::

    staged, buffers = stage(state, buffers={})         # later saves: pass buffers back in
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch

from shardkit import knobs
from shardkit.storage.memcopy import copy_bytes

__all__ = ["stage", "HostCopier"]


def stage(state, buffers: dict[tuple, torch.Tensor], copier: "HostCopier | None" = None):
    """Copy every tensor leaf of ``state`` into a CPU buffer; return (staged state, buffers used).

    Containers are rebuilt (so later changes to the caller's dicts do not
    leak in); plain leaves are shared, being immutable. Buffers from
    ``buffers`` are reused when shape, dtype and pinning match. Device
    tensors are copied non-blocking, then each device is synchronized once;
    host tensors are copied by ``copier`` in one batch.
    """
    used: dict[tuple, torch.Tensor] = {}
    devices: set[torch.device] = set()
    host_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy_leaf(path: tuple, t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        pin = src.device.type == "cuda"
        buf = buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.is_pinned() != pin:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        if src.device.type == "cpu":
            host_pairs.append((buf, src))
        else:
            buf.copy_(src, non_blocking=True)
            devices.add(src.device)
        used[path] = buf
        return buf

    staged = _map_leaves(state, (), copy_leaf)
    (copier or HostCopier()).copy(host_pairs)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return staged, used


def _copy_all(moves: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in moves:
        copy_bytes(dst, src, nbytes)  # releases the GIL while it copies


def _batches(moves: list[tuple[int, int, int]], batch_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Group ``(dst, src, nbytes)`` moves into jobs of about ``batch_bytes``, so small tensors share threads too."""
    jobs, job, size = [], [], 0
    for move in moves:
        job.append(move)
        size += move[2]
        if size >= batch_bytes:
            jobs.append(job)
            job, size = [], 0
    if job:
        jobs.append(job)
    return jobs


def _raw_bytes_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when ``src``'s logical content is exactly its ``nbytes`` of memory, as in ``dst``."""
    return (src.layout == torch.strided and src.is_contiguous() and dst.is_contiguous()
            and not src.is_conj() and not src.is_neg() and not src.is_quantized
            and src.dtype == dst.dtype and src.shape == dst.shape)


class HostCopier:
    """CPU-to-CPU staging copies: contiguous ones as chunked byte copies on a few threads.

    Small tensors are batched into jobs of about the chunk size, so a state
    of many small tensors is spread over the threads as well.

    Why not ``dst.copy_(src)``: torch's intra-op (OpenMP) copy slows down
    several-fold when other processes compete for the cores (its workers spin
    at barriers), which is the usual state of a training box; byte-copy
    chunks on a small thread pool stay near memory bandwidth, and with
    non-temporal stores (``storage.memcopy.copy_bytes``) they skip reading
    the destination into the cache first. Anything not a
    plain run of bytes (non-contiguous, conj/neg views) still uses ``copy_``.
    Chunk size and thread count: ``knobs.IO_CHUNK_BYTES`` and ``knobs.IO_THREADS``.
    """

    def __init__(self):
        self._pool = None
        self._workers = 0

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        step = max(1, knobs.IO_CHUNK_BYTES)
        moves = []
        for dst, src in pairs:
            nbytes = src.numel() * src.element_size()
            if not _raw_bytes_ok(dst, src):
                dst.copy_(src)
            elif nbytes:
                moves += [(dst.data_ptr() + off, src.data_ptr() + off, min(step, nbytes - off))
                          for off in range(0, nbytes, step)]
        jobs = _batches(moves, step)
        workers = max(1, min(knobs.IO_THREADS, os.cpu_count() or 1, len(jobs)))
        if workers == 1:
            for job in jobs:
                _copy_all(job)
            return
        for _ in self._executor(workers).map(_copy_all, jobs):  # re-raises a worker's exception here
            pass

    def _executor(self, workers: int) -> ThreadPoolExecutor:
        if self._pool is None or self._workers != workers:
            self.close()
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="shardkit-stage")
            self._workers = workers
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _map_leaves(node: Any, path: tuple, fn: Callable[[tuple, torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(path, node)
    if isinstance(node, Mapping):
        return {k: _map_leaves(v, path + (k,), fn) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_map_leaves(v, path + (i,), fn) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    return node

"""Staging: copy a state's tensor leaves into reusable CPU buffers, fast.

Used by :class:`~shardkit.checkpoint.background.checkpointer.AsyncCheckpointer` on the
caller's thread, so this is the part of a background save the caller waits
for. Host tensors are copied in chunks on a few threads (non-temporal
stores where ``storage.fast_io.memcopy`` has them, else ``memmove``); CUDA
tensors go to pinned buffers with non-blocking copies and one synchronize
per device. It writes no file and issues no collective.

Fresh buffers (a first save, or a leaf whose shape changed) are faulted in
by helper jobs (one per core) running ahead of the copies, a chunk at a time, with
``storage.fast_io.prefault.populate_for_write`` (one system call per chunk instead of
a trap per page), so the copy of chunk ``i`` overlaps the faulting of chunk
``i + 1``: on a VM that hands out fresh memory slowly, the page faults are
most of a first save's cost.

An incremental background save may ask for some leaves to be *compared*
first (``stage_against``): each piece of such a leaf is compared with what
its buffer already holds (libc ``memcmp``), and copied only where it
differs; a leaf none of whose pieces differed is reported unchanged, its
buffer holding exactly its bytes (``api.stage_for_background`` then proves it
unchanged since the save that buffer was written for).

Example::

    staged, buffers = stage(state, buffers={})         # later saves: pass buffers back in
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Collection, Iterable, Mapping

import torch

from shardkit import knobs
from shardkit.storage import run_parallel
from shardkit.storage.fast_io.memcopy import copy_bytes, equal_at
from shardkit.storage.fast_io.prefault import populate_for_write

__all__ = ["stage", "stage_against", "copy_host", "buffer_for", "map_leaves"]


def stage(state, buffers: dict[tuple, torch.Tensor], *, unfaulted: Collection[int] = ()):
    """Copy every tensor leaf of ``state`` into a CPU buffer; return (staged state, buffers used).
    See :func:`stage_against`, which this is with nothing to compare."""
    staged, used, _ = stage_against(state, buffers, unfaulted=unfaulted)
    return staged, used


def stage_against(state, buffers: dict[tuple, torch.Tensor], *, compare: Collection[tuple] = (),
                  unfaulted: Collection[int] = ()):
    """Copy every tensor leaf of ``state`` into a CPU buffer; return (staged state, buffers used, the
    paths among ``compare`` whose buffer already held exactly the leaf's bytes).

    Containers are rebuilt (so later changes to the caller's dicts do not
    leak in); plain leaves are shared, being immutable. Buffers from
    ``buffers`` are reused when shape, dtype and pinning match. Device
    tensors are copied non-blocking, then each device is synchronized once;
    host tensors are copied by :func:`copy_host` in one batch, which faults
    the new host buffers in ahead of the copy, and those of ``buffers``
    whose ``id`` is in ``unfaulted`` (allocated but maybe not yet faulted in:
    a ``StagingReserve`` stopped early). ``compare``: paths of host leaves whose kept buffer is
    compared piece by piece first, each piece copied only where it differs; a leaf that cannot be
    compared as raw bytes (a device tensor, a view that is not one run of bytes, a new buffer) is
    copied and never reported unchanged.
    """
    used: dict[tuple, torch.Tensor] = {}
    compared: dict[int, tuple] = {}
    devices: set[torch.device] = set()
    host_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    fresh: list[torch.Tensor] = []

    def copy_leaf(path: tuple, t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        pin = src.device.type == "cuda"
        buf, new = buffer_for(buffers.get(path), src.shape, src.dtype, pinned=pin)
        if src.device.type == "cpu":
            host_pairs.append((buf, src))
            if new or id(buf) in unfaulted:
                fresh.append(buf)
            elif path in compare and _raw_bytes_ok(buf, src):
                compared[id(buf)] = path
        else:  # non-blocking into pinned memory, synchronized below; other devices copy before returning
            buf.copy_(src, non_blocking=pin)
            devices.add(src.device)
        used[path] = buf
        return buf

    staged = map_leaves(state, (), copy_leaf)
    differed = copy_host(host_pairs, fresh=fresh, compare=compared.keys())
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return staged, used, {path for buf_id, path in compared.items() if buf_id not in differed}


def buffer_for(old: torch.Tensor | None, shape, dtype: torch.dtype, *, pinned: bool) -> tuple[torch.Tensor, bool]:
    """``old`` when it can hold a tensor of ``shape`` and ``dtype`` (pinned or not), else a new empty
    CPU buffer; and whether it is new."""
    if old is not None and old.shape == shape and old.dtype == dtype and old.is_pinned() == pinned:
        return old, False
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned), True


def _copy_all(moves: list[tuple], differed: set[int]) -> None:
    """Copy each move; one with a buffer id (``compare``) only where its bytes differ, noting the id in
    ``differed`` then (set.add is atomic under the GIL)."""
    for dst, src, nbytes, _fresh, compared in moves:
        if compared is not None:
            if equal_at(dst, src, nbytes):    # memcmp, the GIL released
                continue
            differed.add(compared)
        copy_bytes(dst, src, nbytes)  # releases the GIL while it copies


def _prefault_ahead(jobs: list[list[tuple]], ready: list[threading.Event],
                    first: int = 0, stride: int = 1) -> None:
    """Fault in the fresh destinations of jobs ``first``, ``first + stride``, ... in turn, releasing each
    job's copy as soon as its pages are in."""
    mine = range(first, len(jobs), stride)
    try:
        for i in mine:
            for dst, _src, nbytes, fresh, _compared in jobs[i]:
                if fresh:
                    populate_for_write(dst, nbytes)  # False (not available): the copy faults them itself
            ready[i].set()
    finally:
        for i in mine:  # never leave a copy waiting, whatever happened above
            ready[i].set()


def _prefault_helpers() -> int:
    """How many jobs fault pages in at once: one per core, leaving at least one I/O thread to copy."""
    return max(1, min(os.cpu_count() or 1, knobs.IO_THREADS - 1))


def _copy_when_ready(job: list[tuple], ready: threading.Event, differed: set[int]) -> None:
    ready.wait()
    _copy_all(job, differed)


def _batches(moves: list[tuple], batch_bytes: int) -> list[list[tuple]]:
    """Group ``(dst, src, nbytes, ...)`` moves into jobs of about ``batch_bytes``, so small tensors share threads too."""
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


def copy_host(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, fresh: Iterable[torch.Tensor] = (),
              compare: Collection[int] = ()) -> set[int]:
    """Copy each CPU ``src`` into its CPU ``dst`` (same shape and dtype), in chunks on the I/O threads;
    return the ids among ``compare`` (``id(dst)`` of plain runs of bytes) whose bytes differed.

    Contiguous tensors are copied as runs of bytes (``storage.fast_io.memcopy.copy_bytes``:
    non-temporal stores where available), cut into ``knobs.IO_CHUNK_BYTES``
    pieces and batched so small tensors share threads too; the jobs run on
    ``storage.run_parallel``. Anything not a plain run of bytes
    (non-contiguous, conj/neg views) uses ``dst.copy_(src)``.

    ``fresh``: the destinations among ``pairs`` that were just allocated
    (never written). With ``knobs.STAGING_PREFAULT`` a few extra jobs (one
    per core, at most ``knobs.IO_THREADS - 1``) fault their pages in, batch
    by batch in copy order (helper ``j`` takes batches ``j, j + n, ...``),
    and each batch's copy waits only for its own batch: faulting runs ahead
    of the copies instead of inside them (see ``storage.fast_io.prefault``). They are
    the first jobs handed to the pool, so they have started before any copy
    can wait for them.

    Why not ``dst.copy_(src)`` for everything: torch's intra-op (OpenMP)
    copy slows down several-fold when other processes compete for the cores
    (its workers spin at barriers), which is the usual state of a training
    box; byte-copy chunks on a small thread pool stay near memory bandwidth.

    Example::

        copy_host([(dst, src)], fresh=[dst])   # dst = torch.empty_like(src)
    """
    step = max(1, knobs.IO_CHUNK_BYTES)
    fresh_ids = {id(t) for t in fresh} if knobs.STAGING_PREFAULT else set()
    compare, differed = set(compare), set()
    moves = []
    for dst, src in pairs:
        nbytes = src.numel() * src.element_size()
        if not _raw_bytes_ok(dst, src):
            dst.copy_(src)
            if id(dst) in compare:
                differed.add(id(dst))
        elif nbytes:
            new, compared = id(dst) in fresh_ids, (id(dst) if id(dst) in compare else None)
            moves += [(dst.data_ptr() + off, src.data_ptr() + off, min(step, nbytes - off), new, compared)
                      for off in range(0, nbytes, step)]
    jobs = _batches(moves, step)
    if not any(move[3] for move in moves):
        run_parallel([lambda job=job: _copy_all(job, differed) for job in jobs])
        return differed
    ready = [threading.Event() for _ in jobs]
    helpers = _prefault_helpers()
    run_parallel([lambda first=first: _prefault_ahead(jobs, ready, first, helpers) for first in range(helpers)]
                 + [lambda job=job, event=event: _copy_when_ready(job, event, differed)
                    for job, event in zip(jobs, ready)])
    return differed


def map_leaves(node: Any, path: tuple, fn: Callable[[tuple, torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(path, node)
    if isinstance(node, Mapping):
        return {k: map_leaves(v, path + (k,), fn) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [map_leaves(v, path + (i,), fn) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    # The one mutable plain leaf a save keeps (nested.flatten): copied now, as the tensors are, so a change
    # the caller makes after save_async returns is not what the background save writes.
    return bytearray(node) if isinstance(node, bytearray) else node

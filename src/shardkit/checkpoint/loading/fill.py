"""Fill existing tensors with boxes read by any reader: straight into them where possible, else staged.

The one fill engine of the in-place loads (``load_into`` for shardkit's
format, ``checkpoint.load`` for every format): given the targets (by name),
the dtype each box is saved in, and a ``read(names, outputs)`` that reads
the boxes of ``names`` into ``outputs`` (contiguous CPU tensors of the saved
dtype; others allocated) and returns them, it

- reads the targets that are contiguous CPU tensors of the saved dtype
  straight into their memory, in one call (the reader runs it in parallel);
- reads every other target (on a GPU, non-contiguous, of another dtype
  when casting, or overlapping another target's memory) into temporaries of
  the saved dtype, at most ``knobs.LOAD_STAGE_BYTES`` of them at a time (or
  one box), then ``copy_``s them in, in the targets' order (``copy_`` casts).
  Where every staged target is on the CPU (a cast into fp32 parameters) the
  bound is at most :data:`CPU_STAGE_BYTES`: the host holds the targets and
  the temporaries at once (a bf16 -> fp32 load of a 272 MiB shard staged all
  its 136 MiB of temporaries at once, 1.5x the shard above its baseline).

Given ``read_rows`` (``checkpoint.load`` gives it), a staged CPU target
(a cast into fp32 parameters, a strided view) is filled instead a slab of
rows at a time through one scratch buffer of at most :data:`SLAB_BYTES`
(or one row), reused for every slab and target: a rank's extra memory is
that buffer, not a box, and its pages are faulted once, not once per box.
With ``prefault`` (``checkpoint.load``), each contiguous CPU target's
own pages are faulted in before it is written, in one call
(``storage.fast_io.prefault.populate_for_write``), not 4 KiB by 4 KiB inside
``copy_`` (~15% of a fresh cast on the benchmark VM). Not asked for as
huge pages: ``MADV_HUGEPAGE`` made some loads 3x faster and others 5x
slower (direct compaction, ``defrag=madvise``).

It does not check names, shapes or dtypes (the callers do, before any
read), never reads a box twice, and never allocates a whole tensor a
target does not hold: each temporary is one target's box, or a slab of it.

Example::

    fill({"w": local_w}, {"w": torch.bfloat16}, lambda names, out: source.read_boxes(
        {n: boxes[n] for n in names}, out), apart=set())
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping

import torch

from shardkit import knobs
from shardkit.storage.fast_io.prefault import populate_for_write

__all__ = ["CPU_STAGE_BYTES", "SLAB_BYTES", "fill", "stage_groups"]

#: The most bytes of temporaries staged at once for CPU targets (``knobs.LOAD_STAGE_BYTES`` when smaller).
CPU_STAGE_BYTES = 64 << 20

#: The scratch buffer a staged CPU target is read through, slab by slab, when ``read_rows`` is given.
SLAB_BYTES = 8 << 20

#: ``read_rows(name, first, count, out)``: rows ``first .. first + count`` (dim 0) of ``name``'s box into ``out``.
ReadRows = Callable[[str, int, int, torch.Tensor], None]

#: ``read(names, outputs)``: the boxes of ``names``, into ``outputs`` where given; returns all of them.
Read = Callable[[list[str], Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def fill(targets: Mapping[str, torch.Tensor], saved_dtypes: Mapping[str, torch.dtype], read: Read, *,
         apart: set[str], read_rows: ReadRows | None = None, prefault: bool = False) -> None:
    """Fill each of ``targets`` (detached tensors, the shape of their box) through ``read``; see the module.

    ``apart``: names whose memory overlaps another target's; they are staged and copied in one by one,
    never read into in parallel. ``read_rows``: where given, staged CPU targets go slab by slab.
    ``prefault``: fault each contiguous CPU target's pages in, in one call, before any is written.
    """
    if prefault:
        for t in targets.values():
            _prefault(t)
    direct = {n: t for n, t in targets.items()
              if t.device.type == "cpu" and t.is_contiguous() and t.dtype == saved_dtypes[n] and n not in apart}
    if direct:
        read(list(direct), direct)
        torch.autograd.graph.increment_version(list(direct.values()))  # written behind autograd's back
    pending: list[str] = []
    scratch = _Scratch()
    for name in (n for n in targets if n not in direct):  # in the targets' order: overlaps are written last
        t = targets[name]
        if read_rows is not None and t.device.type == "cpu" and t.dim() > 0 and t.numel() > 0:
            _fill_staged(targets, saved_dtypes, read, pending)
            pending = []
            _fill_rows(name, t, saved_dtypes[name], read_rows, scratch)
        else:
            pending.append(name)
    _fill_staged(targets, saved_dtypes, read, pending)


def _fill_staged(targets, saved_dtypes, read: Read, names: list[str]) -> None:
    """``names`` read into temporaries a group at a time, then ``copy_``'d in, in order."""
    nbytes = {n: targets[n].numel() * saved_dtypes[n].itemsize for n in names}
    on_cpu = all(targets[n].device.type == "cpu" for n in names)
    limit = min(knobs.LOAD_STAGE_BYTES, CPU_STAGE_BYTES) if on_cpu else knobs.LOAD_STAGE_BYTES
    for group in stage_groups(names, nbytes, limit):
        staged = read(group, {})
        for name in group:
            targets[name].copy_(staged[name])


class _Scratch:
    """One reusable buffer per dtype, grown to the largest slab asked for (at most SLAB_BYTES or one row)."""

    def __init__(self):
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)


def _prefault(t: torch.Tensor) -> None:
    """Fault in the pages of ``t`` (contiguous, CPU) with one call; content unchanged."""
    if t.device.type == "cpu" and t.is_contiguous():
        populate_for_write(t.data_ptr(), t.numel() * t.element_size())


def _fill_rows(name: str, target: torch.Tensor, dtype: torch.dtype, read_rows: ReadRows, scratch: _Scratch) -> None:
    """``target`` (CPU, >= 1 dim) filled a slab of rows at a time: read into scratch, then ``copy_`` (casts)."""
    rows, row_shape = target.shape[0], tuple(target.shape[1:])
    per = max(1, SLAB_BYTES // max(1, math.prod(row_shape) * dtype.itemsize))
    for first in range(0, rows, per):
        count = min(per, rows - first)
        out = scratch.view(dtype, (count, *row_shape))
        read_rows(name, first, count, out)
        target.narrow(0, first, count).copy_(out)


def stage_groups(names: list[str], nbytes: Mapping[str, int], limit: int | None = None) -> Iterator[list[str]]:
    """``names`` in groups whose temporaries total at most ``limit`` (None: ``knobs.LOAD_STAGE_BYTES``) or
    hold one name."""
    limit = knobs.LOAD_STAGE_BYTES if limit is None else limit
    group: list[str] = []
    group_bytes = 0
    for name in names:
        if group and group_bytes + nbytes[name] > limit:
            yield group
            group, group_bytes = [], 0
        group.append(name)
        group_bytes += nbytes[name]
    if group:
        yield group

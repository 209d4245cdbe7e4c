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

It does not check names, shapes or dtypes (the callers do, before any
read), never reads a box twice, and never allocates a whole tensor a
target does not hold: each temporary is one target's box.

Example::

    fill({"w": local_w}, {"w": torch.bfloat16}, lambda names, out: source.read_boxes(
        {n: boxes[n] for n in names}, out), apart=set())
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from shardkit import knobs

__all__ = ["CPU_STAGE_BYTES", "fill", "stage_groups"]

#: The most bytes of temporaries staged at once for CPU targets (``knobs.LOAD_STAGE_BYTES`` when smaller).
CPU_STAGE_BYTES = 64 << 20

#: ``read(names, outputs)``: the boxes of ``names``, into ``outputs`` where given; returns all of them.
Read = Callable[[list[str], Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def fill(targets: Mapping[str, torch.Tensor], saved_dtypes: Mapping[str, torch.dtype], read: Read, *,
         apart: set[str]) -> None:
    """Fill each of ``targets`` (detached tensors, the shape of their box) through ``read``; see the module.

    ``apart``: names whose memory overlaps another target's; they are staged and copied in one by one,
    never read into in parallel.
    """
    direct = {n: t for n, t in targets.items()
              if t.device.type == "cpu" and t.is_contiguous() and t.dtype == saved_dtypes[n] and n not in apart}
    if direct:
        read(list(direct), direct)
        torch.autograd.graph.increment_version(list(direct.values()))  # written behind autograd's back
    staged_names = [n for n in targets if n not in direct]
    nbytes = {n: targets[n].numel() * saved_dtypes[n].itemsize for n in staged_names}
    on_cpu = all(targets[n].device.type == "cpu" for n in staged_names)
    limit = min(knobs.LOAD_STAGE_BYTES, CPU_STAGE_BYTES) if on_cpu else knobs.LOAD_STAGE_BYTES
    for group in stage_groups(staged_names, nbytes, limit):
        staged = read(group, {})
        for name in group:  # in the targets' order: where targets overlap, the later one is written last
            targets[name].copy_(staged[name])


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

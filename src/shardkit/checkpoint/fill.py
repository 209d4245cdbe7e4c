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

__all__ = ["fill", "stage_groups"]

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
    for group in stage_groups(staged_names, nbytes):
        staged = read(group, {})
        for name in group:  # in the targets' order: where targets overlap, the later one is written last
            targets[name].copy_(staged[name])


def stage_groups(names: list[str], nbytes: Mapping[str, int]) -> Iterator[list[str]]:
    """``names`` in groups whose temporaries total at most ``knobs.LOAD_STAGE_BYTES`` (or one name)."""
    group: list[str] = []
    group_bytes = 0
    for name in names:
        if group and group_bytes + nbytes[name] > knobs.LOAD_STAGE_BYTES:
            yield group
            group, group_bytes = [], 0
        group.append(name)
        group_bytes += nbytes[name]
    if group:
        yield group

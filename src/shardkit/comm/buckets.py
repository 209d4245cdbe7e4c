"""Pack many tensors into few flat buffers, so one collective moves them all.

:func:`plan_buckets` is pure (sizes and keys in, index lists out) and decides
which tensors share a buffer: same key (dtype and device), in call order, at
most ``max_bucket_bytes`` each (a bigger tensor gets a bucket of its own).
:func:`pack` / :func:`unpack` do the copying. Nothing here communicates.

Example::

    >>> plan_buckets([4, 4, 8], ["f32", "i64", "f32"], max_bucket_bytes=12)
    [[0, 2], [1]]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["plan_buckets", "pack", "unpack", "pack_bytes", "unpack_bytes"]


def plan_buckets(sizes_bytes: Sequence[int], keys: Sequence[Hashable], max_bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors per bucket; a bucket never mixes keys and stays under the cap."""
    open_bucket: dict[Hashable, int] = {}  # key -> position in `buckets` of its filling bucket
    fill: list[int] = []
    buckets: list[list[int]] = []
    for i, (size, key) in enumerate(zip(sizes_bytes, keys)):
        pos = open_bucket.get(key)
        if pos is None or fill[pos] + size > max_bucket_bytes:
            pos = len(buckets)
            buckets.append([])
            fill.append(0)
            open_bucket[key] = pos
        buckets[pos].append(i)
        fill[pos] += size
    return buckets


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding ``tensors``; a lone contiguous tensor is used as is (no copy)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1) if tensors[0].dim() != 1 else tensors[0]
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (nothing to do when ``pack`` did not copy)."""
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
        return
    chunks = [c.view(t.shape) for t, c in zip(tensors, flat.split([t.numel() for t in tensors]))]
    # one dispatch for all copies; detached, as the single-tensor path writes in place (parameters too)
    torch._foreach_copy_([t.detach() for t in tensors], chunks)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``tensors``, any dtypes mixed, as one uint8 buffer."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return _as_bytes(tensors[0])
    return torch.cat([_as_bytes(t) for t in tensors])


def unpack_bytes(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the bytes of ``flat`` back into ``tensors``, reinterpreted as their dtypes."""
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
        return
    sizes = [t.numel() * t.element_size() for t in tensors]
    for t, chunk in zip(tensors, flat.split(sizes)):
        t.detach().copy_(chunk.view(t.dtype).view(t.shape))

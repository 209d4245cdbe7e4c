"""Which destination tensors of a load share memory, so parallel reads never race on one byte.

Loads read many tensors at once, each on the I/O threads, straight into the
caller's tensors. Two destinations over the same memory (a tied
``lm_head.weight`` and embedding, both in a state dict) would then receive
two reads at once, and the result would be a mix of both, differing from run
to run. :func:`shared_destinations` finds them before any byte is read: the
very same view of the same memory (read it once), and views that overlap
otherwise (read them one after the other). It reads and writes no memory and
knows no files.

Example::

    same, overlapping = shared_destinations({"embed": w, "lm_head": w, "bias": b})
    # same == {"lm_head": "embed"}; overlapping == set()
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardkit.errors import TensorMismatchError

__all__ = ["memory_identity", "shared_destinations", "check_disjoint"]


def memory_identity(tensor: torch.Tensor) -> tuple:
    """A key equal for two tensors exactly when they are the same view of the same memory.

    Meta and empty tensors hold no memory (all report address 0): only the
    same object counts as the same view there.
    """
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return ("object", id(tensor))
    return (str(tensor.device), tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def _byte_span(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """``(device, first byte, one past the last byte)`` that ``tensor``'s elements can touch; None: no memory."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))  # torch has no negative strides
    return str(tensor.device), tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def shared_destinations(named: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], set[str]]:
    """``({name: the first name over the very same view}, {names whose memory overlaps another's otherwise})``.

    "First" is in ``named``'s order. The second set is conservative: two
    views interleaved in one buffer (``x[:, 0]`` and ``x[:, 1]``) count as
    overlapping, since their byte spans do. Names in neither may be filled
    in parallel. Sorting the spans makes it ``O(n log n)``.

    >>> w = torch.zeros(4)
    >>> same, overlapping = shared_destinations({"a": w, "b": w, "c": w[1:3], "d": torch.zeros(2)})
    >>> same, sorted(overlapping)
    ({'b': 'a'}, ['a', 'c'])
    """
    first: dict[tuple, str] = {}
    same: dict[str, str] = {}
    spans: list[tuple[tuple[str, int, int], str]] = []
    for name, tensor in named.items():
        key = memory_identity(tensor)
        if key in first:
            same[name] = first[key]
            continue
        first[key] = name
        span = _byte_span(tensor)
        if span is not None:
            spans.append((span, name))
    overlapping: set[str] = set()
    reach: tuple[str, int, str] | None = None  # (device, furthest end so far, its name)
    for (device, start, end), name in sorted(spans):
        if reach is not None and reach[0] == device and start < reach[1]:
            overlapping.update((name, reach[2]))
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, name)
    return same, overlapping


def check_disjoint(named: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise :class:`TensorMismatchError` when two of ``named``'s tensors share memory (about to be filled in parallel).

    >>> w = torch.zeros(4)
    >>> check_disjoint({"a": w, "b": w}, "outputs")
    Traceback (most recent call last):
    ...
    shardkit.errors.TensorMismatchError: outputs 'b' and 'a' are the same memory; parallel reads into them would race. Pass one of them
    """
    same, overlapping = shared_destinations(named)
    if same:
        name, first = next(iter(same.items()))
        raise TensorMismatchError(f"{what} {name!r} and {first!r} are the same memory; parallel reads into them would race. "
                         f"Pass one of them")
    if overlapping:
        raise TensorMismatchError(f"{what} {sorted(overlapping)[:4]} overlap in memory; parallel reads into them would race. "
                         f"Read them apart")

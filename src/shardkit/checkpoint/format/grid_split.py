"""How one dimension of a tensor is cut into parts: the per-dimension half of a compact grid entry.

A *split* of a dimension of ``n`` elements into ``count`` parts (some
possibly empty), in O(1) words, with O(1) or O(log) lookups and no list
of ``count`` parts built unless asked for (``sizes_array``):

- :class:`ChunkSplit` ``(n, counts)``: ``torch.chunk`` applied level by
  level (a DTensor's ``Shard(d)`` over the mesh dimensions that shard ``d``,
  in mesh order): level ``k`` cuts each part of the level above into
  ``counts[k]`` parts of ``ceil(len / counts[k])`` elements, the last ones
  shorter or empty. ``counts == ()`` is the whole dimension (one part).
  JSON: ``null`` (whole) or ``{"chunk": [4096]}``.
- :class:`EvenSplit` ``(n, k)``: ``layout.compute_shard_sizes`` (the first
  ``n % k`` parts one longer). JSON ``{"even": k}``.
- :class:`SizesSplit`: explicit sizes. JSON ``{"sizes": [3, 0, 5]}``.

Part ``i`` of a multi-level chunk split is the row-major index over its
levels. Pure arithmetic: no torch, no files; :func:`parse_split` checks a
hostile JSON value before anything is computed from it.

Example::

    s = ChunkSplit(10, (4,))            # torch.chunk(10 elements, 4): 3, 3, 3, 1
    s.count, s.size(3), s.offset(3)     # 4, 1, 9
    list(s.overlapping(2, 7))           # [0, 1, 2]
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.errors import MetadataError
from shardkit.layout import compute_shard_sizes
from shardkit.storage.json_io import short_repr

__all__ = ["ChunkSplit", "EvenSplit", "SizesSplit", "Split", "parse_split", "split_of_sizes"]


#: At most this many nested chunk levels per dimension (one per mesh dimension sharding it).
_MAX_LEVELS = 64


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ChunkSplit:
    """Nested ``torch.chunk`` of ``n`` elements by ``counts`` (see the module docstring)."""

    n: int
    counts: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return math.prod(self.counts)

    def _walk(self, i: int) -> tuple[int, int]:
        offset, length = 0, self.n
        digits = []
        for k in reversed(self.counts):
            i, j = divmod(i, k)
            digits.append(j)
        for k, j in zip(self.counts, reversed(digits)):
            c = _ceil_div(length, k)
            start = min(j * c, length)
            offset, length = offset + start, min(c, length - start)
        return offset, length

    def offset(self, i: int) -> int:
        return self._walk(i)[0]

    def size(self, i: int) -> int:
        return self._walk(i)[1]

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """The non-empty parts that share an element with ``[lo, hi)``, in index order."""
        out: list[int] = []
        self._find(0, self.n, 0, 0, lo, hi, out)
        return out

    def _find(self, base: int, length: int, level: int, index: int, lo: int, hi: int, out: list[int]) -> None:
        if level == len(self.counts):
            if length and lo < base + length and base < hi:
                out.append(index)
            return
        k = self.counts[level]
        c = _ceil_div(length, k)
        if not c:
            return
        first = max(0, (lo - base) // c)
        last = min(k - 1, (hi - 1 - base) // c, (length - 1) // c)
        for j in range(first, last + 1):
            start = j * c
            self._find(base + start, min(c, length - start), level + 1, index * k + j, lo, hi, out)

    def sizes_array(self) -> np.ndarray:
        lengths = np.array([self.n], dtype=np.int64)
        for k in self.counts:
            c = -(-lengths // k)
            starts = np.arange(k, dtype=np.int64)[None, :] * c[:, None]
            lengths = np.clip(lengths[:, None] - starts, 0, c[:, None]).reshape(-1)
        return lengths

    def to_json(self) -> Any:
        return {"chunk": list(self.counts)} if self.counts else None


@dataclass(frozen=True)
class EvenSplit:
    """``compute_shard_sizes(n, k)``: the first ``n % k`` parts one element longer."""

    n: int
    k: int

    @property
    def count(self) -> int:
        return self.k

    def size(self, i: int) -> int:
        base, extra = divmod(self.n, self.k)
        return base + (i < extra)

    def offset(self, i: int) -> int:
        base, extra = divmod(self.n, self.k)
        return i * base + min(i, extra)

    def overlapping(self, lo: int, hi: int) -> list[int]:
        return [i for i in _bisect_range(self, lo, hi) if self.size(i)]

    def sizes_array(self) -> np.ndarray:
        return np.array(compute_shard_sizes(self.n, self.k), dtype=np.int64)

    def to_json(self) -> Any:
        return {"even": self.k}


@dataclass(frozen=True)
class SizesSplit:
    """Explicit part sizes (``starts`` are their running sums)."""

    sizes: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def starts(self) -> list[int]:
        return list(itertools.accumulate(self.sizes, initial=0))

    def size(self, i: int) -> int:
        return self.sizes[i]

    def offset(self, i: int) -> int:
        return sum(self.sizes[:i])

    def overlapping(self, lo: int, hi: int) -> list[int]:
        starts = self.starts
        first = max(0, bisect.bisect_right(starts, lo) - 1)
        last = min(len(self.sizes), bisect.bisect_left(starts, hi))
        return [i for i in range(first, last) if self.sizes[i]]

    def sizes_array(self) -> np.ndarray:
        return np.array(self.sizes, dtype=np.int64)

    def to_json(self) -> Any:
        return {"sizes": list(self.sizes)}


Split = ChunkSplit | EvenSplit | SizesSplit


def _bisect_range(split, lo: int, hi: int) -> range:
    """Parts ``first..last`` whose span meets ``[lo, hi)``, by bisection on ``split.offset``."""
    first = bisect.bisect_right(range(split.count), lo, key=split.offset) - 1
    last = bisect.bisect_left(range(split.count), hi, key=split.offset)
    return range(max(0, first), min(split.count, last))


def split_of_sizes(n: int, sizes: list[int]) -> Split:
    """The shortest split whose parts are ``sizes`` (which sum to ``n``): one chunk or even split when
    it is one, explicit sizes otherwise.

    >>> split_of_sizes(10, [3, 3, 3, 1]), split_of_sizes(10, [3, 3, 2, 2]), split_of_sizes(4, [1, 3])
    (ChunkSplit(n=10, counts=(4,)), EvenSplit(n=10, k=4), SizesSplit(sizes=(1, 3)))
    """
    k = len(sizes)
    if k == 1:
        return ChunkSplit(n)
    if ChunkSplit(n, (k,)).sizes_array().tolist() == sizes:
        return ChunkSplit(n, (k,))
    if compute_shard_sizes(n, k) == sizes:
        return EvenSplit(n, k)
    return SizesSplit(tuple(sizes))


def parse_split(raw: Any, n: int, max_parts: int, what: str) -> Split:
    """A split of a dimension of ``n`` elements from its JSON, in at most ``max_parts`` parts.

    Raises :class:`MetadataError` for anything else (unknown kind, counts not
    positive, sizes that do not sum to ``n``, more parts than allowed); it
    computes nothing whose cost the file merely claims.
    """
    if raw is None:
        return ChunkSplit(n)
    if not isinstance(raw, dict) or len(raw) != 1:
        raise MetadataError(f"{what} is {short_repr(raw)}; expected null, {{\"chunk\": [...]}}, "
                            f"{{\"even\": k}} or {{\"sizes\": [...]}}")
    (kind, value), = raw.items()
    if kind not in ("chunk", "even", "sizes"):
        raise MetadataError(f"{what} has split kind {short_repr(kind)}; known: chunk, even, sizes")
    if kind == "even":
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= max_parts:
            raise MetadataError(f"{what} splits evenly into {short_repr(value)} parts; expected 1..{max_parts}")
        return EvenSplit(n, value)
    max_items = _MAX_LEVELS if kind == "chunk" else max_parts
    if not isinstance(value, list) or len(value) > max_items or any(
            not isinstance(v, int) or isinstance(v, bool) or v < (1 if kind == "chunk" else 0) for v in value):
        raise MetadataError(f"{what}: {kind} is {short_repr(value)}; expected a list of at most {max_items} "
                            f"integers ({'>= 1' if kind == 'chunk' else '>= 0'})")
    if kind == "chunk":
        parts = 1
        for v in value:
            parts *= v
            if parts > max_parts:
                raise MetadataError(f"{what} cuts into {short_repr(value)} parts, more than the {max_parts} allowed")
        return ChunkSplit(n, tuple(value))
    if sum(value) != n:
        raise MetadataError(f"{what} has sizes summing to {sum(value)}, but the dimension has {n} elements")
    return SizesSplit(tuple(value))

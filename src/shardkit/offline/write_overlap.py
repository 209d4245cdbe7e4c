"""Read the next tensor while the file writer writes the current one, in two reused buffers.

The offline writers hand :func:`~shardkit.storage.write_safetensors` lazy
tensors that it produces one at a time, writing (and hashing) each before
it asks for the next. :class:`ReadAhead` knows the order the writer will
ask in, and while item ``i`` is written it reads item ``i + 1`` on one
background thread into the other of two buffers, so reading and writing
overlap. The buffers are kept for the whole run: fresh memory is faulted in
once, not once per tensor (on the 2-core VM a fresh 128 MiB tensor costs
more to fault in than to fill). Memory: the two buffers, each the largest
item; an item larger than ``knobs.OFFLINE_READ_AHEAD_MAX_BYTES`` is not read
ahead (it is read when asked for), so the second buffer stays at most that.

It does not decide what is read or how: each item brings ``fill(out)``,
which fills a contiguous CPU tensor in place. A tensor it returns is valid
until the item after next is produced (its buffer is then reused): the
writer's contract, not a general one.

Example::

    ahead = ReadAhead([(key, dtype, shape, fill), ...])
    lazies = {key: ahead.lazy(key) for key in keys}   # LazyTensors for write_safetensors
    ...
    ahead.close()
"""

from __future__ import annotations

import errno
import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Optional

import torch

from shardkit import knobs
from shardkit.dtypes import itemsize_bytes
from shardkit.errors import CheckpointIOError
from shardkit.storage import LazyTensor

__all__ = ["ReadAhead"]

log = logging.getLogger("shardkit.offline")
Fill = Callable[[torch.Tensor], None]


class ReadAhead:
    """Items ``(key, dtype, shape, fill)`` in the order they will be asked for; see the module docstring."""

    def __init__(self, items: list[tuple[Hashable, torch.dtype, tuple[int, ...], Fill]]):
        self._items = list(items)
        self._index = {key: i for i, (key, _, _, _) in enumerate(self._items)}
        self._slots: list[Optional[torch.Tensor]] = [None, None]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-readahead")
        self._ahead: Optional[tuple[int, Future]] = None

    def lazy(self, key: Hashable) -> LazyTensor:
        """The :class:`LazyTensor` of item ``key`` (its ``load`` returns the filled buffer view)."""
        _, dtype, shape, _ = self._items[self._index[key]]
        return LazyTensor(dtype, tuple(shape), lambda: self.take(key))

    def take(self, key: Hashable) -> torch.Tensor:
        """Item ``key``, filled (waiting for its read-ahead, or reading it now), then start the next read."""
        i = self._index[key]
        out = None
        if self._ahead is not None:
            j, future = self._ahead
            self._ahead = None
            filled = future.result()  # also when j != i: its buffer must be idle before it is reused
            out = filled if j == i else None
        if out is None:
            out = self._fill(i)
        if i + 1 < len(self._items) and self._nbytes(i + 1) <= knobs.OFFLINE_READ_AHEAD_MAX_BYTES:
            self._ahead = (i + 1, self._pool.submit(self._fill, i + 1))
        return out

    def _nbytes(self, i: int) -> int:
        _, dtype, shape, _ = self._items[i]
        return math.prod(shape) * itemsize_bytes(dtype)

    def _fill(self, i: int) -> torch.Tensor:
        _, dtype, shape, fill = self._items[i]
        out = self._view(i % 2, dtype, shape)
        fill(out)
        return out

    def _view(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * itemsize_bytes(dtype)
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            self._slots[slot] = None  # let the old one go before the new one is faulted in
            buf = self._slots[slot] = _allocate(nbytes, dtype, shape)
            log.debug("read-ahead buffer %d: %d bytes", slot, nbytes)
        return buf[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Wait for a read in flight, free both buffers, stop the thread."""
        if self._ahead is not None:
            _, future = self._ahead
            self._ahead = None
            future.exception()
        self._pool.shutdown(wait=True)
        self._slots = [None, None]

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _allocate(nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``nbytes`` of host memory; out of memory is a ``CheckpointIOError`` (``ENOMEM``), not torch's
    bare ``RuntimeError``: a tensor too large for this machine, or metadata that claims one."""
    try:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)
    except (RuntimeError, MemoryError) as e:  # a 1-D uint8 torch.empty fails only for want of memory
        raise CheckpointIOError(
            f"out of host memory: a tensor of shape {list(shape)} ({dtype}) needs {nbytes} bytes, which this "
            f"machine could not allocate. Free memory or run on a larger machine; if the checkpoint cannot "
            f"hold a tensor that large, its metadata is corrupt: run `shardkit validate` on it",
            errno.ENOMEM, "out of host memory") from e


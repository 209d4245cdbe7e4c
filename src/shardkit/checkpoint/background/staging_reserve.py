"""Staging buffers allocated ahead of the first background save, faulted in on a thread of their own.

A first ``save_async`` must allocate one host copy of the state and touch
every page of it before it can return; on a VM that hands out fresh memory
slowly that is most of what the caller waits for (``checkpoint.background.staging``).
:class:`StagingReserve` does that work earlier, while the caller goes on
(start-up, the first training steps): it allocates a buffer per tensor leaf
of a state, exactly as ``staging.stage`` would, and faults each one in with
``storage.fast_io.prefault.populate_for_write``, a chunk at a time, on a daemon
thread. The save then takes the buffers over with :meth:`StagingReserve.take`,
which stops the thread after its current chunk (a few milliseconds for host
memory; a CUDA tensor's pinned buffer is allocated in one call, which can
take longer), and faults in only what the thread had not reached yet.

What it does not do: it copies no value (the save does), it takes no lock on
the state (it reads only each leaf's shape, dtype and device, on the
caller's thread), and it never raises from its thread: a failure there (out
of host memory) ends it early, and the save allocates the rest itself and
reports its own error.

Example::

    reserve = StagingReserve(state, buffers={})   # returns at once
    ...                                           # training goes on
    buffers, unfaulted = reserve.take()
    staged, buffers = stage(state, buffers, unfaulted=unfaulted)
"""

from __future__ import annotations

import logging
import threading
from typing import Collection

import torch

from shardkit import knobs
from shardkit.checkpoint.background.staging import buffer_for, map_leaves
from shardkit.storage.fast_io.prefault import PAGE_BYTES, populate_for_write

__all__ = ["StagingReserve"]

log = logging.getLogger("shardkit.checkpoint")


class StagingReserve:
    """Allocate and fault in staging buffers for ``state`` on a background thread; see the module docstring.

    ``buffers``: the buffers kept from an earlier save or reserve (path ->
    tensor); those that still fit a leaf are kept, and faulted in only when
    their ``id`` is in ``unfaulted`` (another reserve stopped early).
    """

    def __init__(self, state, buffers: dict[tuple, torch.Tensor], unfaulted: Collection[int] = ()):
        self._specs: list[tuple] = []

        def record(path: tuple, t: torch.Tensor) -> torch.Tensor:
            self._specs.append((path, t.shape, t.dtype, t.device.type == "cuda"))
            return t

        map_leaves(state, (), record)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._old = dict(buffers)
        self._old_unfaulted = set(unfaulted)
        self._unfaulted: set[int] = set()
        self._stop = threading.Event()
        self._done = threading.Event()
        # A daemon: a job that never saves must not wait for it at exit (it holds nothing to flush).
        self._thread = threading.Thread(target=self._run, name="shardkit-staging-reserve", daemon=True)
        self._thread.start()

    def take(self) -> tuple[dict[tuple, torch.Tensor], set[int]]:
        """Stop the thread (after its current chunk) and return ``(buffers, unfaulted)``.

        ``buffers`` maps a leaf's path to its buffer (leaves the thread had
        not reached are missing: the save allocates them); ``unfaulted``
        holds the ``id`` of each buffer not yet wholly faulted in. Kept
        buffers (``buffers`` given to the constructor) of leaves it had not
        reached are handed back as they were. Waits on an event, never a
        thread join; interrupted (Ctrl-C), the thread still stops after its
        chunk. Call it once.
        """
        self._stop.set()
        self._done.wait()
        return self._buffers, self._unfaulted

    @property
    def done(self) -> bool:
        """True once every buffer is allocated and faulted in (or the thread stopped)."""
        return self._done.is_set()

    def _run(self) -> None:
        try:
            for path, shape, dtype, pinned in self._specs:
                if self._stop.is_set():
                    return
                buf, new = buffer_for(self._old.get(path), shape, dtype, pinned=pinned)
                self._buffers[path] = buf
                if (new or id(buf) in self._old_unfaulted) and not pinned:  # pinning touched its pages
                    self._fault_in(buf)
        except Exception as e:  # noqa: BLE001 - the save allocates what is missing and reports its own error
            log.debug("staging reserve stopped early: %s: %s", type(e).__name__, e)
        finally:
            self._hand_back_unreached()
            self._done.set()

    def _hand_back_unreached(self) -> None:
        """Stopped early: the kept buffers of the leaves not reached yet go to the save as they are
        (it checks that they fit), so a late reserve never costs the save a buffer it already had. A kept
        buffer of a path the state no longer has is dropped here, not held until the save."""
        leaves = {path for path, *_ in self._specs}
        for path, buf in self._old.items():
            if path in leaves and path not in self._buffers:
                self._buffers[path] = buf
                if id(buf) in self._old_unfaulted:
                    self._unfaulted.add(id(buf))
        self._old, self._old_unfaulted = {}, set()

    def _fault_in(self, buf: torch.Tensor) -> None:
        """Fault in the whole pages of ``buf``, a chunk at a time (the bytes before its first and after
        its last whole page are the copy's to touch); leave its id in ``_unfaulted`` if stopped."""
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        start = -(-addr // PAGE_BYTES) * PAGE_BYTES
        end = (addr + nbytes) // PAGE_BYTES * PAGE_BYTES
        step = max(PAGE_BYTES, knobs.IO_CHUNK_BYTES // PAGE_BYTES * PAGE_BYTES)
        self._unfaulted.add(id(buf))
        for chunk in range(start, end, step):
            if self._stop.is_set():
                return
            if not populate_for_write(chunk, min(step, end - chunk)):
                return  # not available here (or failed): the save's copy faults the pages itself
        self._unfaulted.discard(id(buf))

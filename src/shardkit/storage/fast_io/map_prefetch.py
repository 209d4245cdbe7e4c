"""Bring a mapped file's pages in ahead of first use, on one background thread.

A tensor over a memory map of a file costs nothing to create and a page
fault the first time each of its pages is read. ``safetensors.torch.load_file``
leaves every fault to the caller's first touch; :func:`prefetch_mapped`
instead hands the byte ranges of the tensors just returned to one
background thread that maps them with ``madvise(MADV_POPULATE_READ)``
(Linux >= 5.14): one system call per chunk instead of a trap per few pages,
on a core the caller is not using, and, where the file is not in the page
cache yet, disk reads ahead of the caller's touches. The call returns at
once; the caller's touches and the thread's chunks meet wherever they meet
(a page is faulted once, by whichever comes first).

:func:`advise_huge_pages` asks for large page-cache folios under a map
(``MADV_HUGEPAGE``): a file first read through such a map is cached in
large folios, which later maps (any process's) fault in many pages at a
time.

What it is not: it never reads a byte into Python, never copies, never
changes what a tensor holds, and never raises: where the kernel lacks the
advice (or THP is off) the caller's own touches fault the pages as before.
Past the end of a file truncated under the map the kernel answers
``EFAULT`` instead of SIGBUS, and the thread drops that range. The mapped
pages count in the process's RSS, as they do once a ``load_file`` result is
touched (they are page-cache pages shared with every other reader, not
private memory). ``knobs.MAP_PREFETCH = False`` turns both off.

Example::

    mapping = store.map_private(path)                   # huge-page advice applied there
    prefetch_mapped(mapping, [(begin, end - begin)])    # returns at once
    wait_for_prefetch()                                 # only tests and benchmarks wait
"""

from __future__ import annotations

import collections
import os
import threading

from shardkit import knobs
from shardkit.storage.fast_io.memcopy import buffer_address
from shardkit.storage.fast_io.prefault import MADV_HUGEPAGE, MADV_POPULATE_READ, advise

__all__ = ["advise_huge_pages", "prefetch_mapped", "wait_for_prefetch"]


def advise_huge_pages(mapping) -> bool:
    """Ask for large folios under the whole of ``mapping`` (an ``mmap.mmap``); True if the kernel took it."""
    if not knobs.MAP_PREFETCH or len(mapping) == 0:
        return False
    return advise(buffer_address(mapping), len(mapping), MADV_HUGEPAGE)


def prefetch_mapped(mapping, ranges) -> int:
    """Queue ``(offset, nbytes)`` ranges of ``mapping`` for the background thread; the bytes queued.

    ``mapping`` is kept alive until its ranges are done. Ranges are fetched
    in file order, overlapping and touching ones joined, in chunks of
    ``knobs.MAP_PREFETCH_CHUNK_BYTES``; empty ones and ranges outside the map are skipped.
    """
    if not knobs.MAP_PREFETCH:
        return 0
    size = len(mapping)
    jobs = _joined([(o, n) for o, n in ranges if n > 0 and 0 <= o and o + n <= size])
    if not jobs:
        return 0
    _PREFETCHER.submit(mapping, jobs)
    return sum(n for _, n in jobs)


def wait_for_prefetch(timeout_s: float | None = None) -> bool:
    """Block until every queued range is done; False if ``timeout_s`` passed first."""
    return _PREFETCHER.wait_idle(timeout_s)


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    joined: list[list[int]] = []
    for offset, nbytes in sorted(ranges):
        if joined and offset <= joined[-1][0] + joined[-1][1]:
            joined[-1][1] = max(joined[-1][1], offset + nbytes - joined[-1][0])
        else:
            joined.append([offset, nbytes])
    return [(offset, nbytes) for offset, nbytes in joined]


class _Prefetcher:
    """One daemon thread draining a queue of (mapping, ranges); started on first use."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, mapping, jobs) -> None:
        with self._cond:
            self._queue.append((mapping, jobs))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="shardkit-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._queue)
                mapping, jobs = self._queue.popleft()
                self._busy = True
            try:
                _populate(mapping, jobs)
            except (ValueError, BufferError, OSError):  # e.g. a map closed meanwhile: nothing to bring in
                pass
            del mapping


def _populate(mapping, jobs) -> None:
    base, step = buffer_address(mapping), max(1 << 20, knobs.MAP_PREFETCH_CHUNK_BYTES)
    for offset, nbytes in jobs:
        for start in range(offset, offset + nbytes, step):
            if not advise(base + start, min(step, offset + nbytes - start), MADV_POPULATE_READ):
                break  # unsupported, or past a truncated end: leave the rest to the caller's touches


_PREFETCHER = _Prefetcher()


def _fresh_prefetcher_in_child() -> None:
    # A forked child has no prefetch thread, and the parent's lock may have
    # been held at the fork: start over (the parent's queue is the parent's).
    global _PREFETCHER
    _PREFETCHER = _Prefetcher()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_prefetcher_in_child)

"""Count the bytes read from local files: ``with counting_reads() as counted: ...; counted.total()``.

Every reader ``LocalStorage.open_reader`` opens is wrapped; each ``read_into``
(which the other read methods of ``Reader`` go through) is recorded by file
name, offset and length. Maps (``map_range``) are passed through uncounted.
Usable in a rank process too (the ranks of ``tests/ranks.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading

from shardkit.storage import LocalStorage, Reader


class Counted:
    def __init__(self):
        self.reads: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def add(self, name: str, offset: int, nbytes: int) -> None:
        with self._lock:
            self.reads.append((name, offset, nbytes))

    def total(self, suffix: str = "", at_or_after: int = 0) -> int:
        """Bytes read from files whose name ends with ``suffix``, counting only those at ``at_or_after`` or later."""
        return sum(max(0, offset + n - max(offset, at_or_after)) for name, offset, n in self.reads
                   if name.endswith(suffix))


class _CountingReader(Reader):
    def __init__(self, inner: Reader, counted: Counted):
        super().__init__(inner.name, inner.size_bytes)
        self._inner, self._counted = inner, counted
        self.extra_reads_are_cheap = inner.extra_reads_are_cheap

    def read_into(self, offset: int, out: memoryview) -> None:
        self._counted.add(os.fspath(self.name), offset, out.nbytes)
        self._inner.read_into(offset, out)

    def map_range(self, offset: int, nbytes: int, *, prefetch: bool = True):
        return self._inner.map_range(offset, nbytes, prefetch=prefetch)

    def close(self) -> None:
        self._inner.close()


@contextlib.contextmanager
def counting_reads():
    original = LocalStorage.open_reader
    counted = Counted()

    def open_reader(self, path):
        return _CountingReader(original(self, path), counted)

    LocalStorage.open_reader = open_reader
    try:
        yield counted
    finally:
        LocalStorage.open_reader = original

"""The open data files of a DCP checkpoint: a bounded set of readers, and one record as a seekable stream.

:class:`OpenReaders` holds at most ``knobs.DCP_OPEN_FILES`` readers open (a
DCP saved with one file per tensor has thousands); :class:`RecordView` shows
the byte range of one ``torch.save`` record as a read-only stream, for
``zipfile`` and ``torch.load``. Neither parses anything nor writes.

Example::

    files = OpenReaders(lambda name: storage.open_reader(f"{directory}/{name}"))
    with files.use("__0_0.distcp") as reader:
        head = RecordView(reader, offset, length).read(64)
"""

from __future__ import annotations

import io
import threading
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import Callable, Iterator

from shardkit import knobs
from shardkit.storage import Reader

__all__ = ["OpenReaders", "RecordView"]


class RecordView(io.RawIOBase):
    """The byte range ``[offset, offset + length)`` of an open file, as a seekable read-only stream."""

    def __init__(self, reader: Reader, offset: int, length: int):
        self._reader, self._offset, self._length, self._pos = reader, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        if n:
            self._reader.read_into(self._offset + self._pos, memoryview(buf).cast("B")[:n])
            self._pos += n
        return n


class OpenReaders:
    """The data files' readers, at most ``knobs.DCP_OPEN_FILES`` kept open, the least recently used closed first.

    A DCP saved with one file per tensor has thousands of files: holding every
    one open ran out of file descriptors (EMFILE). A reader that a read (on any
    thread) is using is never closed, so the bound may be passed by the reads
    in flight. It does not open anything before it is asked for.
    """

    def __init__(self, open_reader: Callable[[str], Reader]):
        self._open_reader = open_reader
        self._lock = threading.Lock()
        self._readers: OrderedDict[str, Reader] = OrderedDict()
        self._in_use: Counter[str] = Counter()

    @contextmanager
    def use(self, file_name: str) -> Iterator[Reader]:
        with self._lock:
            if file_name not in self._readers:
                self._trim(room=1)  # before the open: the bound is on descriptors held at once
                self._readers[file_name] = self._open_reader(file_name)
            self._readers.move_to_end(file_name)
            self._in_use[file_name] += 1
            reader = self._readers[file_name]
        try:
            yield reader
        finally:
            with self._lock:
                self._in_use[file_name] -= 1
                if self._in_use[file_name] <= 0:
                    del self._in_use[file_name]
                self._trim()

    def _trim(self, room: int = 0) -> None:
        excess = len(self._readers) + room - max(1, knobs.DCP_OPEN_FILES)
        if excess > 0:
            for name in [n for n in self._readers if n not in self._in_use][:excess]:
                self._readers.pop(name).close()

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

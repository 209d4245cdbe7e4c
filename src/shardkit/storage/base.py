"""The storage interface: :class:`Storage` (a place that holds files) and :class:`Reader` (an open file).

Backends implement it, one per file: ``storage.local`` (plain files) and
``storage.fsspec_store`` (any fsspec URL: object stores, memory). Callers
use only these methods and never test which backend they have;
:func:`shardkit.storage.storage_for` picks one from a path.

Example::

    store, root = storage_for("/ckpt/step-100")
    with store.atomic_writer(store.join(root, "metadata.json")) as f:
        f.write(b"{}")
"""

from __future__ import annotations

import contextlib
import mmap
from typing import BinaryIO

__all__ = ["Reader", "Storage"]


class Reader:
    """An open file that reads at explicit offsets (no shared seek position for local files)."""

    def __init__(self, name: str, size_bytes: int):
        self.name = name
        self.size_bytes = size_bytes

    def read_into(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        pass

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _short(self, offset: int, wanted: int, got: int) -> EOFError:
        return EOFError(
            f"{self.name}: wanted {wanted} bytes at offset {offset}, the file ended after {got}; "
            f"it is truncated (size now {self.size_bytes} bytes)"
        )


class Storage:
    """The operations shardkit needs from a place that holds files."""

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def size_bytes(self, path: str) -> int:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        """Base names of the entries directly inside ``path``."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def open_reader(self, path: str) -> Reader:
        raise NotImplementedError

    def atomic_writer(self, path: str, durable: bool = True) -> contextlib.AbstractContextManager[BinaryIO]:
        """A file that appears at ``path`` whole when the block exits cleanly, or not at all.

        ``durable``: also flushed to stable storage before it appears (local
        files: fsync of the file and its directory); where the store has no
        such step the flag changes nothing.
        """
        raise NotImplementedError

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = "") -> contextlib.AbstractContextManager:
        """Hold the exclusive writer lock ``slot`` of ``directory`` for a ``with`` block.

        Creates ``directory`` if needed. A second holder of the same slot
        fails at once with :class:`~shardkit.errors.CheckpointBusyError`,
        whose message names the first (pid, host, since when, ``holder``);
        it never waits. Slots are independent (a distributed save takes one
        per rank; slot 0 is the directory's main writer, also taken by HF
        saves). Local files: an ``flock``'d hidden file (see ``storage.lock``;
        :func:`~shardkit.storage.is_lock_name` names it) that the kernel
        releases when its holder dies. Stores without locks (fsspec, object
        stores) hold nothing: one writer per directory is then the caller's
        to ensure.

        Example::

            with store.writer_lock(root, holder="my export"):
                ...  # write the files of the checkpoint in root
        """
        raise NotImplementedError

    def map_private(self, path: str) -> "mmap.mmap | None":
        """A copy-on-write memory map of the whole file, or None where files cannot be mapped.

        Writes through the map never reach the file. Only local files can be
        mapped; remote storage returns None and callers read instead.
        """
        return None

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        """The whole file, refusing one larger than ``max_bytes``."""
        with self.open_reader(path) as r:
            if r.size_bytes > max_bytes:
                from shardkit.errors import MetadataError

                raise MetadataError(
                    f"{path} is {r.size_bytes} bytes, over the limit of {max_bytes} for this kind "
                    f"of file; it is not a file shardkit wrote, or it is corrupt"
                )
            return r.read(0, r.size_bytes)

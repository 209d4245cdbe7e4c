"""Any fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...) behind the storage interface.

Example::

    store = FsspecStorage("memory://ckpt")
    with store.atomic_writer("memory://ckpt/metadata.json") as f:
        f.write(b"{}")
"""

from __future__ import annotations

import contextlib
from typing import BinaryIO, Iterator

from shardkit.errors import MissingShardError
from shardkit.storage.base import Reader, Storage

__all__ = ["FsspecStorage"]


class _FileObjReader(Reader):
    """Reader over a seekable file object (fsspec); not thread-safe, so it locks."""

    def __init__(self, name: str, fobj: BinaryIO, size_bytes: int):
        import threading

        super().__init__(name, size_bytes)
        self._f = fobj
        self._lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        with self._lock:
            self._f.seek(offset)
            done = 0
            while done < len(out):
                chunk = self._f.read(len(out) - done)
                if not chunk:
                    raise self._short(offset, len(out), done)
                out[done : done + len(chunk)] = chunk
                done += len(chunk)

    def close(self) -> None:
        self._f.close()


class FsspecStorage(Storage):
    """Any fsspec filesystem. Atomicity is the store's own (object stores publish on close)."""

    def __init__(self, url: str):
        import fsspec

        self.fs, _ = fsspec.core.url_to_fs(url)
        self._protocol = url.split("://", 1)[0]

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._strip(path))

    def size_bytes(self, path: str) -> int:
        return int(self.fs.size(self._strip(path)))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._strip(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._strip(path), detail=False))

    def remove(self, path: str) -> None:
        self.fs.rm(self._strip(path))

    def open_reader(self, path: str) -> Reader:
        stripped = self._strip(path)
        try:
            size = int(self.fs.size(stripped))
            return _FileObjReader(path, self.fs.open(stripped, "rb"), size)
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = ""):
        # No advisory locks on object stores, and a marker object would stay behind a
        # killed writer and block every later save: nothing is held here (documented
        # in Storage.writer_lock), only the directory is made, as the local lock does.
        self.makedirs(directory)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def atomic_writer(self, path: str, durable: bool = True) -> Iterator[BinaryIO]:
        # Object stores persist on close; ``durable`` changes nothing here.
        # Write under a temporary name, then move: on stores where mv is a copy,
        # readers still never see a half-written final name.
        tmp = self._strip(path) + ".tmp-shardkit"
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self.fs.mv(tmp, self._strip(path))
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

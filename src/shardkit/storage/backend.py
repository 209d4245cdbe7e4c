"""Where bytes live: :func:`storage_for` picks the backend for a path.

Plain paths (and ``file://``) go to :class:`LocalStorage` (``storage.local``),
which uses ``os`` calls directly (positional reads, fsync, atomic rename);
anything with another scheme (``s3://``, ``memory://``, ...) goes to
:class:`FsspecStorage` (``storage.fsspec_store``). The interface is in
``storage.base``. Backends move bytes only; they know nothing of tensors or
checkpoints.

Example::

    store, path = storage_for("/ckpt/step-100")
    with store.atomic_writer(store.join(path, "metadata.json")) as f:
        f.write(b"{}")
    with store.open_reader(path) as r:
        r.read_into(offset=0, out=memoryview(buf))
"""

from __future__ import annotations

import os

from shardkit.storage.base import BufferReader, Reader, Storage
from shardkit.storage.fsspec_store import FsspecStorage
from shardkit.storage.local import LocalStorage, check_regular_file

__all__ = ["BufferReader", "Reader", "Storage", "LocalStorage", "FsspecStorage", "storage_for", "check_regular_file"]


def storage_for(path: str | os.PathLike) -> tuple[Storage, str]:
    """The backend for ``path`` and the path as that backend spells it."""
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        return FsspecStorage(path), path
    if path.startswith("file://"):
        path = path[len("file://") :]
    return LocalStorage(), path

"""Where bytes live: :func:`storage_for` picks the backend for a path.

Plain paths (and ``file:`` URLs, read per RFC 8089 by :func:`file_url_path`)
go to :class:`LocalStorage` (``storage.backends.local``), which uses ``os`` calls
directly (positional reads, fsync, atomic rename); anything with another
scheme (``s3://``, ``memory://``, ...) goes to :class:`FsspecStorage`
(``storage.backends.fsspec_store``). The interface is in
``storage.backends.base``. Backends move bytes only; they know nothing of tensors or
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
import urllib.parse

from shardkit.errors import MetadataError
from shardkit.storage.backends.base import BufferReader, Reader, Storage
from shardkit.storage.backends.fsspec_store import FsspecStorage
from shardkit.storage.backends.local import LocalStorage, check_regular_file

__all__ = ["BufferReader", "Reader", "Storage", "LocalStorage", "FsspecStorage", "storage_for", "check_regular_file",
           "file_url_path"]


def storage_for(path: str | os.PathLike) -> tuple[Storage, str]:
    """The backend for ``path`` and the path as that backend spells it (a ``file:`` URL as its local path)."""
    path = os.fspath(path)
    if path[:5].lower() == "file:":
        return LocalStorage(), file_url_path(path)
    if "://" in path:
        _check_bucket(path)
        return FsspecStorage(path), path
    return LocalStorage(), path


#: Object stores whose URLs start with a bucket (or container): ``s3://bucket/key``.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def _check_bucket(url: str) -> None:
    """Refuse an object-store URL that names no bucket (``s3://``, ``s3:///key``), before any request."""
    scheme, rest = url.split("://", 1)
    if scheme.lower() in _BUCKET_SCHEMES and not rest.split("/", 1)[0]:
        raise MetadataError(f"{url!r} names no bucket: write {scheme}://<bucket>/<path>, e.g. "
                            f"{scheme}://my-bucket/checkpoints/run1")


def file_url_path(url: str) -> str:
    """The local path a ``file:`` URL names (RFC 8089), percent-decoded.

    Taken: ``file:///p``, ``file://localhost/p`` and ``file:/p``, in any
    case (``FILE:///p``). Refused with :class:`MetadataError`: another host
    (``file://server/p`` is a network path, not this machine's), a relative
    form (``file:p``, ``file://p`` where ``p`` has no host), a query or a
    fragment (``?``, ``#``: percent-encode them as ``%3F``, ``%23``).
    Example: ``file_url_path("file:///tmp/a%20b") == "/tmp/a b"``.
    """
    parts = urllib.parse.urlsplit(url)
    problem = None
    if parts.netloc.lower() not in ("", "localhost"):
        problem = (f"names the host {parts.netloc!r}; only this machine's files are read (no host, or "
                   f"localhost): write file:///path, or mount the share and pass its local path")
    elif not parts.path.startswith("/"):
        problem = "is not an absolute path; write file:///absolute/path, or pass a plain (relative) path"
    elif "?" in url or "#" in url:
        problem = ("has a query or fragment ('?' or '#'), which name no file; percent-encode them in a file "
                   "name (%3F, %23), or pass the plain path")
    if problem:
        raise MetadataError(f"the file URL {url!r} {problem}")
    return urllib.parse.unquote(parts.path)

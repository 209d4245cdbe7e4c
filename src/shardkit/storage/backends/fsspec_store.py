"""Any fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...) behind the storage interface.

Writes: object stores (S3, GCS, Azure) publish an object only when its
upload completes, so a file is written straight to its final key and
appears whole or not at all; a writer that fails discards its upload, and
one that is killed leaves at most an incomplete multipart upload, which no
listing or read ever sees (``Storage.remove_orphans`` aborts those; a
bucket lifecycle rule ``AbortIncompleteMultipartUpload`` does it for you).
On S3 the parts go up ``knobs.OBJECT_UPLOAD_PARTS_IN_FLIGHT`` at a time, sent from the
caller's memory where a sink writes them (no copy). Other
fsspec stores (``memory://``, sftp, ...) are written under
``storage.temp_name`` and moved to the final name.

Paths are literal: ``[ ] * ?`` in a name are plain characters. Deletions and
moves use single-object calls on names a listing gave (never fsspec's
``rm`` / ``mv``, which expand them as glob patterns).

Reads fetch exactly the byte ranges asked for (ranged GETs, split into
``knobs.OBJECT_PART_BYTES`` parts fetched concurrently; adjacent buffers
of a gather read are one range), never a whole object or a read-ahead
block: :func:`fetched_bytes` counts them. On S3 the bodies stream straight
into the caller's buffers.

Failures of the store's client (botocore, aiohttp, s3fs's own ``OSError``: an
unreachable endpoint, a refused permission, a broken transfer) are raised as
:class:`~shardkit.errors.CheckpointIOError` naming the URL and the operation
(``storage.backends.store_errors``); a missing object stays a ``FileNotFoundError`` /
:class:`~shardkit.errors.MissingShardError`.

Configuration (endpoint, credentials) is fsspec's own: ``fsspec.config.conf``
or ``FSSPEC_S3_ENDPOINT_URL``-style environment variables, or botocore's
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...).

Example::

    store = FsspecStorage("s3://bucket/ckpt")
    with store.atomic_writer("s3://bucket/ckpt/metadata.json") as f:
        f.write(b"{}")
"""

from __future__ import annotations

import contextlib
from typing import BinaryIO, Iterator

from shardkit import knobs
from shardkit.errors import MetadataError, MissingShardError
from shardkit.storage.backends.atomic import temp_name
from shardkit.storage.backends.base import Reader, Storage
from shardkit.storage.backends.fsspec_readers import RangeReader, S3RangeReader, StoreFile, fetched_bytes
from shardkit.storage.backends.lock import is_lock_name
from shardkit.storage.backends.s3_upload import NOTHING_PUBLISHED, S3MultipartWriter, S3PartSink
from shardkit.storage.backends.store_errors import store_errors, translated

__all__ = ["FsspecStorage", "fetched_bytes"]

#: Protocols whose stores publish an object only when its upload completes.
_PUBLISH_ON_CLOSE = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_S3 = frozenset({"s3", "s3a"})
#: What a failed removal leaves.
_REMOVAL_OUTCOME = "Some of what was to be removed may still be there; removing it again is safe."
#: The most keys one S3 DeleteObjects request takes.
_DELETE_BATCH = 1000

class FsspecStorage(Storage):
    """Any fsspec filesystem: object stores publish on upload completion, others by a move."""

    def __init__(self, url: str):
        import fsspec

        # Listings are never cached: another rank or process may have written since.
        self.fs, _ = fsspec.core.url_to_fs(url, use_listings_cache=False)
        self._protocol = url.split("://", 1)[0]

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    @translated("check whether there is anything at")
    def exists(self, path: str) -> bool:
        return self.fs.exists(self._strip(path))

    @translated("read the size of")
    def size_bytes(self, path: str) -> int:
        return int(self.fs.size(self._strip(path)))

    @translated("make the directory", "Nothing was written.")
    def makedirs(self, path: str) -> None:
        """Object stores: a prefix needs no making, and a bucket is never made (a mistyped name would be
        created silently): a missing one is a :class:`MissingShardError`. Other stores: ``fs.makedirs``."""
        if self._protocol in _PUBLISH_ON_CLOSE:
            self._require_bucket(path)
        else:
            self.fs.makedirs(self._strip(path), exist_ok=True)

    def _require_bucket(self, path: str) -> None:
        bucket = self._strip(path).split("/", 1)[0]
        if not bucket:
            raise MetadataError(f"{path} names no bucket; write {self._protocol}://<bucket>/<path>")
        try:
            if self._protocol in _S3:
                self.fs.call_s3("head_bucket", Bucket=bucket)   # one request; a 404 is FileNotFoundError
            elif not self.fs.exists(bucket):
                raise FileNotFoundError(bucket)
        except FileNotFoundError as e:
            raise MissingShardError(
                f"the bucket {bucket!r} of {path} does not exist; nothing was written, and no bucket is "
                f"created for you (a mistyped name would be). Create it first (for S3: aws s3 mb "
                f"{self._protocol}://{bucket}), or fix the bucket name in the URL") from e

    @translated("list")
    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._strip(path), detail=False)
        except FileNotFoundError:
            return []
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in entries})

    @translated("remove", _REMOVAL_OUTCOME)
    def remove(self, path: str) -> None:
        # One exact key: ``fs.rm`` would expand ``[ ] * ?`` in the name as a glob pattern.
        self.fs.rm_file(self._strip(path))

    @translated("remove", _REMOVAL_OUTCOME)
    def remove_files(self, paths: list[str]) -> None:
        if self._protocol not in _S3:
            return super().remove_files(paths)
        # One DeleteObjects per bucket: S3 deletes a missing key without complaint, so
        # nothing is asked first (an exists() costs a HEAD and, when absent, a LIST).
        by_bucket: dict[str, list[str]] = {}
        for path in paths:
            bucket, _, key = self._strip(path).partition("/")
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for start in range(0, len(keys), _DELETE_BATCH):
                self._delete_objects(bucket, keys[start:start + _DELETE_BATCH])

    def _delete_objects(self, bucket: str, keys: list[str]) -> None:
        """One DeleteObjects of exact ``keys`` (at most S3's 1000)."""
        out = self.fs.call_s3("delete_objects", Bucket=bucket,
                              Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            raise OSError(f"could not delete {', '.join(e.get('Key', '?') for e in errors)} in bucket "
                          f"{bucket}: {errors[0].get('Code')} {errors[0].get('Message', '')}")
        for key in keys:
            self.fs.invalidate_cache(f"{bucket}/{key}")

    @translated("look up")
    def isdir(self, path: str) -> bool:
        return self.fs.isdir(self._strip(path))

    @translated("remove", _REMOVAL_OUTCOME)
    def remove_tree(self, path: str) -> None:
        self._delete_tree(self._strip(path).rstrip("/"))
        self._abort_uploads_under(path)

    def _delete_tree(self, key: str) -> None:
        """Delete the object ``key`` or every object under the prefix ``key/``, then its empty directories.

        Every name comes from a listing and is deleted as it is: ``[ ] * ?``
        in a key are plain characters here (``fs.rm`` would expand them as
        glob patterns and delete a sibling such as ``expl`` for ``exp[l]``).
        """
        try:
            found = self.fs.find(key, withdirs=True, detail=True)
        except FileNotFoundError:
            found = {}
        files = [name for name, info in found.items() if info.get("type") != "directory"]
        if self._protocol in _S3:
            self.remove_files(files)
            self._remove_folder_entries(key)
            return
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(name)
        for name in sorted((n for n, i in found.items() if i.get("type") == "directory"), reverse=True):
            with contextlib.suppress(OSError):  # deepest first; a directory only implied by its files is gone
                self.fs.rmdir(name)

    def _remove_folder_entries(self, key: str) -> None:
        # Folder entries (``<prefix>/``: what S3 consoles create, and what SeaweedFS keeps for a
        # prefix emptied object by object) would still list as a directory, deepest first; on a
        # store that keeps none (AWS), one listing and a no-op delete.
        bucket, _, prefix = key.partition("/")
        if not prefix:
            return
        try:
            entries = self.fs.ls(key, detail=True)
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry["name"].rstrip("/")
            if entry.get("type") == "directory" and name != key:
                self._remove_folder_entries(name)
        self.fs.call_s3("delete_object", Bucket=bucket, Key=prefix + "/")

    @translated("clear", _REMOVAL_OUTCOME)
    def clear_directory(self, path: str) -> list[str]:
        # One listing and one bulk delete; writer_lock keeps no lock objects here, but a
        # name is still spared the way the interface says.
        key = self._strip(path).rstrip("/")
        try:
            entries = self.fs.ls(key, detail=False)
        except FileNotFoundError:
            entries = []
        doomed = [e.rstrip("/") for e in entries
                  if e.rstrip("/") != key and not is_lock_name(e.rstrip("/").rsplit("/", 1)[-1])]
        for entry in doomed:
            self._delete_tree(entry)
        return [self.join(path, e.rsplit("/", 1)[-1]) for e in doomed] + self._abort_uploads_under(path)

    def _abort_uploads_under(self, path: str, uploads_of=None) -> list[str]:
        return self._abort_uploads(self._strip(path), uploads_of) if self._protocol in _S3 else []

    @translated("read the modification time of")
    def modified_time(self, path: str) -> float:
        return self.fs.modified(self._strip(path)).timestamp()

    def same_path(self, path: str) -> str:
        return f"{self._protocol}://{self._strip(path).rstrip('/')}"

    @translated("open")
    def open_file(self, path: str):
        try:
            return StoreFile(self.fs.open(self._strip(path), "rb", block_size=knobs.OBJECT_PART_BYTES), path)
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e

    @translated("open")
    def open_reader(self, path: str) -> Reader:
        stripped = self._strip(path)
        try:
            size = int(self.fs.size(stripped))
        except FileNotFoundError as e:
            raise MissingShardError(f"{path} does not exist") from e
        return (S3RangeReader if self._protocol in _S3 else RangeReader)(path, self.fs, stripped, size)

    def open_sink(self, f, durable: bool = True, checksum: bool = False, size_bytes: int | None = None,
                  inline: bool = False, mode=None):
        """S3: the writer's pieces go out as upload parts without a copy (``storage.backends.s3_upload``),
        paced by ``mode.pace`` where a background save gives one; other stores: sequential writes
        (``Storage.open_sink``)."""
        if isinstance(f, S3MultipartWriter):
            f.expect_bytes(size_bytes)
            f.pace = None if mode is None else mode.pace
            return S3PartSink(f)
        return super().open_sink(f, durable, checksum, size_bytes, inline, mode)

    def writer_lock(self, directory: str, *, slot: int = 0, holder: str = ""):
        # No advisory locks on object stores, and a marker object would stay behind a
        # killed writer and block every later save: nothing is held here (documented
        # in Storage.writer_lock), only the directory is made, as the local lock does.
        self.makedirs(directory)
        return contextlib.nullcontext()

    def atomic_writer(self, path: str, durable: bool = True):
        # Stores persist on close; ``durable`` changes nothing here.
        # The store's failures in the writer's own calls are typed (``store_errors``; the S3
        # upload types its own); what the caller's block raises is left as it is.
        if self._protocol in _S3:
            return self._s3_writer(path)
        if self._protocol in _PUBLISH_ON_CLOSE:
            return self._direct_writer(path)
        return self._moved_writer(path)

    @contextlib.contextmanager
    def _s3_writer(self, path: str) -> Iterator[BinaryIO]:
        f = S3MultipartWriter(self.fs, self._strip(path))
        try:
            yield f
            f.commit()
        except BaseException:
            f.abort()
            raise

    @contextlib.contextmanager
    def _direct_writer(self, path: str) -> Iterator[BinaryIO]:
        with store_errors(path, "open for writing", NOTHING_PUBLISHED):
            f = self.fs.open(self._strip(path), "wb", block_size=knobs.OBJECT_PART_BYTES)
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # drop the upload: closing would publish what was written so far
            with contextlib.suppress(Exception):
                f.closed = True  # and never closed (published) later by the garbage collector
            raise
        with store_errors(path, "write", NOTHING_PUBLISHED):
            f.close()

    @contextlib.contextmanager
    def _moved_writer(self, path: str) -> Iterator[BinaryIO]:
        key = self._strip(path)
        parent, _, name = key.rpartition("/")
        tmp = f"{parent}/{temp_name(name)}" if parent else temp_name(name)
        try:
            with store_errors(path, "open a temporary object for", NOTHING_PUBLISHED):
                f = self.fs.open(tmp, "wb")
            try:
                yield f
            finally:
                with store_errors(path, "write", NOTHING_PUBLISHED):
                    f.close()
            with store_errors(path, "publish", NOTHING_PUBLISHED):
                # Single-file calls: ``fs.mv`` / ``fs.rm`` expand ``[ ] * ?`` in a name as glob patterns.
                self.fs.cp_file(tmp, key)
                self.fs.rm_file(tmp)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise

    @translated("remove the leftovers of unfinished saves in", _REMOVAL_OUTCOME)
    def remove_orphans(self, directory: str, *, uploads_of=None) -> list[str]:
        return super().remove_orphans(directory) + self._abort_uploads_under(directory, uploads_of)

    def _abort_uploads(self, directory_key: str, uploads_of=None) -> list[str]:
        """Abort the incomplete uploads under ``directory_key`` (all, or those under an entry ``uploads_of`` takes)."""
        bucket, _, key = directory_key.rstrip("/").partition("/")
        prefix = key + "/" if key else ""
        aborted = []
        for upload in self._incomplete_uploads(bucket, prefix):
            if uploads_of is not None and not uploads_of(upload["Key"][len(prefix):].split("/", 1)[0]):
                continue  # not the caller's: another job's upload in flight, perhaps
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted.append(f"{self._protocol}://{bucket}/{upload['Key']} (incomplete upload)")
        return aborted

    def _incomplete_uploads(self, bucket: str, prefix: str) -> Iterator[dict]:
        """Every incomplete multipart upload whose key starts with ``prefix``, page after page (1000 a page)."""
        markers: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            yield from page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return
            markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

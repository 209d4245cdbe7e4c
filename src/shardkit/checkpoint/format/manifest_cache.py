"""Parsed manifests remembered by their exact bytes, for callers that re-read the same steps often.

A :class:`~shardkit.checkpoint.CheckpointManager` reads the manifest
of every step it keeps at each rotation (is it complete, which steps does it
reference, its metrics): for a state of a few hundred tensors each parse
checks every tensor's chunks and takes ~20 ms of Python, all of it holding
the GIL while training runs beside the save. :class:`ManifestCache` still
reads ``metadata.json`` every time (a few KB), and returns the earlier parse
only when the bytes read are *exactly* the bytes that were parsed: the parse
is a function of the bytes alone, so a hit can never be stale, whatever
happened to the directory in between (rewritten, replaced, removed and
saved again). What it does not cache: the existence checks, the rank
manifests, the data files' sizes (the callers read those each time).

The cached :class:`~shardkit.checkpoint.format.manifest.Manifest` objects
are shared between hits: only for callers that read them, never change them.

Example::

    manifests = ManifestCache()
    m = manifests.read(storage, "/ckpt/step-3")     # parsed
    m = manifests.read(storage, "/ckpt/step-3")     # same bytes: the same object, not parsed again
"""

from __future__ import annotations

import collections
import threading

from shardkit.checkpoint.format.manifest import Manifest, parse_manifest, read_manifest
from shardkit.storage import Storage

__all__ = ["ManifestCache"]


class ManifestCache:
    """``read(storage, directory)``: :func:`read_manifest`, its parse reused while the bytes are the same.

    Holds at most ``max_entries`` manifests of ``max_bytes`` of JSON in all (the least recently read
    go first; a manifest larger than that is parsed every time); safe to share between threads (a
    manager's rotation thread and its caller).
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 64 << 20):
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[str, tuple[bytes, Manifest]] = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def read(self, storage: Storage, directory: str) -> Manifest:
        """:func:`read_manifest` of ``directory`` (the same errors)."""
        return read_manifest(storage, directory, parse=self._parse)

    def _parse(self, source: str, data: bytes) -> Manifest:
        with self._lock:
            hit = self._entries.get(source)
            if hit is not None and hit[0] == data:
                self._entries.move_to_end(source)
                return hit[1]
        manifest = parse_manifest(source, data)  # outside the lock: other readers go on meanwhile
        with self._lock:
            self._drop(source)
            self._entries[source] = (data, manifest)
            self._cached_bytes += len(data)
            while self._entries and (len(self._entries) > self._max_entries or self._cached_bytes > self._max_bytes):
                self._drop(next(iter(self._entries)))
        return manifest

    def _drop(self, source: str) -> None:
        dropped = self._entries.pop(source, None)
        if dropped is not None:
            self._cached_bytes -= len(dropped[0])

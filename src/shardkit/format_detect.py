"""The one format detector: which kind of checkpoint a directory holds, by the names of its files.

Every reader asks here (``shardkit.checkpoint.load``, ``sources.open_source``,
the CLI's ``checkpoint_kind``, ``hf.get_checkpoint_metadata``), so a
directory is the same kind to all of them. The order, first match wins:

1. ``metadata.json``: a shardkit distributed checkpoint (``"distributed"``);
2. Hugging Face (``"hf"``), in ``from_pretrained``'s order: ``model.safetensors``,
   ``model.safetensors.index.json``, ``pytorch_model.bin``, ``pytorch_model.bin.index.json``;
3. ``.metadata``: a PyTorch DCP checkpoint (``"dcp"``);
4. no commit marker, but data files of a save that never finished:
   ``rank_*.safetensors`` / ``rank_*.json`` (distributed), ``*.distcp`` (DCP).
   (Hugging Face shards without their index are no checkpoint: the error lists them.)

So a directory holding both ``metadata.json`` and a Hugging Face index is
distributed to every tool (``metadata.json`` is written last, the commit of a
complete training state). Detection reads no file contents, and for local
paths imports nothing but ``os`` (the CLI fails fast on bad input); stores
(``s3://``, ``memory://``) are asked through ``shardkit.storage``.

Completeness (every file the commit names is there at its size) is checked above the
readers, in ``sources/completeness.py`` (:func:`~shardkit.sources.complete_kind`); this module
sits below ``checkpoint``, ``hf`` and ``sources`` and imports none of them.

Example::

    detect_kind("ckpt/step-100")         # "distributed", "hf" or "dcp"; raises for anything else
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError

__all__ = ["DISTRIBUTED", "HF", "DCP", "KINDS", "KIND_NAMES", "MARKERS", "Found", "format_of_names", "find_format",
           "first_marker", "detect_kind", "describe_names"]

DISTRIBUTED, HF, DCP = "distributed", "hf", "dcp"
KINDS = (DISTRIBUTED, HF, DCP)
KIND_NAMES = {DISTRIBUTED: "shardkit distributed", HF: "Hugging Face", DCP: "PyTorch DCP"}

#: The commit markers in detection order: the first one present decides the kind.
MARKERS = (
    ("metadata.json", DISTRIBUTED),
    ("model.safetensors", HF),
    ("model.safetensors.index.json", HF),
    ("pytorch_model.bin", HF),
    ("pytorch_model.bin.index.json", HF),
    (".metadata", DCP),
)
#: Data files a save writes before its marker: present without one, the save never finished.
_UNCOMMITTED = (
    (re.compile(r"^rank_\d+\.(safetensors|json)$"), DISTRIBUTED),
    (re.compile(r"^.*\.distcp$"), DCP),
)
_EXPECTED = ("metadata.json (shardkit), model.safetensors[.index.json] or pytorch_model.bin[.index.json] "
             "(Hugging Face), or .metadata (PyTorch DCP)")


@dataclass(frozen=True)
class Found:
    """What :func:`format_of_names` found: the ``kind``, and its ``marker`` file (None: no marker,
    only data files of a save that never finished)."""

    kind: str
    marker: str | None

    @property
    def committed(self) -> bool:
        return self.marker is not None


def format_of_names(names: Iterable[str]) -> Found | None:
    """The checkpoint a directory holding the entries ``names`` is, in the module's order; None: none.

    Pure: no I/O. Example: ``format_of_names(["metadata.json", "model.safetensors"])`` is distributed.
    """
    names = set(names)
    for marker, kind in MARKERS:
        if marker in names:
            return Found(kind, marker)
    for pattern, kind in _UNCOMMITTED:
        if any(pattern.match(n) for n in names):
            return Found(kind, None)
    return None


def _is_url(path) -> bool:
    text = os.fspath(path)
    return "://" in text and text[:5].lower() != "file:"


def _names(path) -> list[str] | None:
    """The entries of the directory ``path`` (None: it does not exist); ``MetadataError`` for a file."""
    if not _is_url(path):
        local = _local(path)
        if not os.path.exists(local):
            return None
        if not os.path.isdir(local):
            raise MetadataError(f"{path} is a file, not a checkpoint directory; pass the directory that holds it")
        try:
            return os.listdir(local)
        except OSError as e:
            raise MetadataError(f"{path} cannot be listed ({e.strerror}); check its permissions") from e
    from shardkit.storage import storage_for

    store, root = storage_for(path)
    # Markers by exists() in detection order, up to the first present (one request each, never a stale
    # listing); the listing only without one.
    present = next((m for m, _ in MARKERS if store.exists(store.join(root, m))), None)
    return [present] if present is not None else store.listdir(root) or None


def _local(path) -> str:
    text = os.fspath(path)
    if text[:5].lower() != "file:":
        return text
    from shardkit.storage.backends.choose import file_url_path  # storage_for's own reading of it

    return file_url_path(text)


def find_format(path) -> Found | None:
    """:func:`format_of_names` of the directory ``path`` (local or a store URL); None when it holds no
    checkpoint or does not exist. ``MetadataError`` when ``path`` is a file."""
    names = _names(path)
    return None if names is None else format_of_names(names)


def first_marker(path, kind: str) -> str | None:
    """The first of ``kind``'s markers present in ``path`` in detection order (None: none), whatever other
    kinds the directory holds: the layout a reader of that kind uses when asked for it (``--from hf``)."""
    names = set(_names(path) if not _is_url(path) else _store_markers(path, kind))
    return next((m for m, k in MARKERS if k == kind and m in names), None)


def _store_markers(path, kind: str) -> list[str]:
    from shardkit.storage import storage_for

    store, root = storage_for(path)
    return [m for m, k in MARKERS if k == kind and store.exists(store.join(root, m))][:1]


def describe_names(names: Iterable[str], limit: int = 8) -> str:
    """What a directory holds, for a message: ``"it is empty"`` or ``"it holds 3 entries: a, b, c"``."""
    names = sorted(names)
    if not names:
        return "it is empty"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"it holds {len(names)} entr{'y' if len(names) == 1 else 'ies'}: {', '.join(names[:limit])}{more}"


def detect_kind(path) -> str:
    """``"distributed"``, ``"hf"`` or ``"dcp"`` for the complete-looking checkpoint in ``path``.

    Raises :class:`MissingShardError` when ``path`` does not exist,
    :class:`IncompleteCheckpointError` for data files without their commit
    marker (a save that never finished), :class:`MetadataError` for a file or
    a directory holding no checkpoint, saying what it holds instead.
    """
    names = _names(path)
    if names is None:
        raise MissingShardError(f"{path} does not exist; pass a checkpoint directory")
    found = format_of_names(names)
    if found is None:
        raise MetadataError(f"{path} is not a checkpoint: {describe_names(names)}; a checkpoint shardkit reads "
                            f"has {_EXPECTED}")
    if not found.committed:
        marker = next(m for m, k in MARKERS if k == found.kind)
        raise IncompleteCheckpointError(
            f"{path} holds {KIND_NAMES[found.kind]} data files but no {marker}: "
            f"the save never finished ({describe_names(names)}). Load an earlier checkpoint")
    return found.kind

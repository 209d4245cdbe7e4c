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

:func:`complete_kind` / :func:`format_problems` also check completeness
(every file the commit names is there at its size; headers, not tensor data).

Example::

    detect_kind("ckpt/step-100")         # "distributed", "hf" or "dcp"; raises for anything else
    complete_kind("ckpt/step-100")       # the kind, or None when not a complete checkpoint
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError

__all__ = ["DISTRIBUTED", "HF", "DCP", "KINDS", "KIND_NAMES", "MARKERS", "Found", "format_of_names", "find_format",
           "first_marker", "detect_kind", "complete_kind", "format_problems", "describe_names"]

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


def format_problems(path) -> tuple[str | None, list[str]]:
    """``(kind or None, why it is not a complete checkpoint)``; ``[]``: complete. Reads no tensor data.

    Complete means: the commit marker is there and every data file it names
    exists with a readable header at its recorded size (distributed: sizes in
    ``metadata.json``; Hugging Face: ``hf.checkpoint_problems``; DCP: the
    restricted unpickler's ``.metadata``, every ``.distcp`` it names long
    enough for its records). Raises only for failures that are not about the
    checkpoint (an unreachable store: ``CheckpointIOError``).
    """
    try:
        kind = detect_kind(path)
    except (MissingShardError, IncompleteCheckpointError, MetadataError) as e:
        found = find_format(path) if not isinstance(e, MissingShardError) else None
        return (found.kind if found else None), [str(e)]
    check = {DISTRIBUTED: _distributed_problems, HF: _hf_problems, DCP: _dcp_problems}[kind]
    return kind, check(path)


def complete_kind(path) -> str | None:
    """The kind of the checkpoint in ``path`` when it is complete (see :func:`format_problems`), else None.

    For a manager choosing a step to restore: ``complete_kind(d) is not None`` means ``checkpoint.load``
    reads ``d``. Reads no tensor data. Example: ``complete_kind("run/step-3") == "dcp"``.
    """
    kind, problems = format_problems(path)
    return kind if not problems else None


def _distributed_problems(path) -> list[str]:
    from shardkit.checkpoint.format.manifest import file_records, read_manifest
    from shardkit.storage import storage_for

    store, directory = storage_for(path)
    try:
        records = file_records(store, directory, read_manifest(store, directory))
    except (IncompleteCheckpointError, MetadataError, MissingShardError) as e:
        return [str(e)]
    problems = []
    for name, record in records.items():
        file_path = store.join(directory, name)
        size = store.size_bytes(file_path) if store.exists(file_path) else None
        if size != record.bytes:
            problems.append(f"{file_path} is {'missing' if size is None else f'{size} bytes'}; metadata.json "
                            f"records {record.bytes} bytes")
    return problems


def _hf_problems(path) -> list[str]:
    from shardkit.hf.directory import checkpoint_problems

    return checkpoint_problems(os.fspath(path))


def _dcp_problems(path) -> list[str]:
    from shardkit.errors import ChecksumError
    from shardkit.sources.dcp import DcpCheckpoint

    try:
        checkpoint = DcpCheckpoint(path)  # .metadata through the restricted unpickler, chunks checked
    except (IncompleteCheckpointError, MetadataError, MissingShardError, ChecksumError) as e:
        return [str(e)]
    with checkpoint:
        store, directory = checkpoint.storage, checkpoint.directory
        chunks = [c for t in checkpoint.tensors.values() for c in t.chunks] + list(checkpoint.values.values())
    end_of: dict[str, int] = {}
    for chunk in chunks:
        end_of[chunk.file_name] = max(end_of.get(chunk.file_name, 0), chunk.offset + chunk.length)
    problems = []
    for file_name, end in sorted(end_of.items()):
        file_path = store.join(directory, file_name)
        size = store.size_bytes(file_path) if store.exists(file_path) else None
        if size is None or size < end:
            problems.append(f"{file_path} is {'missing' if size is None else f'{size} bytes'}; .metadata places "
                            f"records up to byte {end} in it: the DCP save never finished")
    return problems

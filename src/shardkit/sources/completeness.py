"""Is a directory a complete checkpoint, and of which kind: :func:`complete_kind`, :func:`format_problems`.

Complete means the commit marker the one detector (``shardkit.format_detect``) finds is there and every
data file it names exists at its recorded size, with a readable header. Reads headers and metadata, never
tensor data; writes nothing. It asks each format's own reader, so it sits above ``checkpoint``'s format
modules, ``hf.directory`` and the DCP reader.

Example::

    complete_kind("ckpt/step-100")       # "distributed", "hf" or "dcp"; None when not a complete checkpoint
    format_problems("ckpt/step-100")     # ("distributed", []) when complete
"""

from __future__ import annotations

import os

from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError
from shardkit.format_detect import DCP, DISTRIBUTED, HF, detect_kind, find_format

__all__ = ["complete_kind", "format_problems"]


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
    from shardkit.checkpoint.format.references import data_path
    from shardkit.storage import storage_for

    store, directory = storage_for(path)
    try:
        records = file_records(store, directory, read_manifest(store, directory))
    except (IncompleteCheckpointError, MetadataError, MissingShardError) as e:
        return [str(e)]
    problems = []
    for name, record in records.items():
        file_path = data_path(store, directory, name)   # a base's file (version 3) lies in a sibling
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

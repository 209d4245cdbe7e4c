"""What proves a checkpoint directory is shardkit's own, and which names in it shardkit wrote.

A ``CheckpointManager`` save marks its step directory (:data:`OWNER_FILE`,
written by rank 0 before any rank writes a data byte), so a directory cut
short by a crash at any moment is still recognisable as its own. (A plain
``save`` writes no mark: nothing deletes its directory but its caller.) :func:`own_names` tells apart the
names a save writes (the commit, data files, rank records, the mark, writer
locks, temporaries) from anything else. What it does not do: delete anything (the
manager does); it never calls another tool's directory (a PyTorch DCP
``.metadata``, a Hugging Face index, a user's notes) shardkit's.

Example::

    names = storage.listdir(step_dir)
    if proves_owned(names):          # the mark or a writer lock: a shardkit save was here
        keep = foreign_names(names)  # what shardkit never deletes
"""

from __future__ import annotations

import re

from shardkit.checkpoint.format.manifest import FORMAT, METADATA_FILE, read_manifest, write_json
from shardkit.errors import MetadataError
from shardkit.storage import Storage, is_lock_name, is_temp_name

__all__ = ["OWNER_FILE", "mark_owned", "is_own_name", "foreign_names", "proves_owned", "owned_listing",
           "sample_names"]

#: The mark of a shardkit save in its directory (JSON, a few bytes); kept after the commit.
OWNER_FILE = ".shardkit-checkpoint"

_RANK_FILE = re.compile(r"rank_(0|[1-9][0-9]*)\.(safetensors|json)")


def mark_owned(storage: Storage, directory: str) -> None:
    """Write the mark that says a shardkit save owns ``directory`` (atomically; before any data byte)."""
    write_json(storage, storage.join(directory, OWNER_FILE),
               {"format": FORMAT, "written_by": "shardkit.checkpoint.CheckpointManager"})


def is_own_name(name: str) -> bool:
    """Whether a save of shardkit's format writes a file of this base name."""
    return (name in (METADATA_FILE, OWNER_FILE) or bool(_RANK_FILE.fullmatch(name))
            or is_lock_name(name) or is_temp_name(name))


def foreign_names(names) -> list[str]:
    """The names among ``names`` that no shardkit save writes, sorted."""
    return sorted(n for n in names if not is_own_name(n))


def proves_owned(names) -> bool:
    """Whether a directory holding ``names`` was a shardkit save's without reading any file: its mark,
    or a local writer lock (saves from before the mark was written took one). A committed
    ``metadata.json`` of shardkit's format proves it too; that needs a read (the manager does it)."""
    return any(n == OWNER_FILE or is_lock_name(n) for n in names)


def owned_listing(storage: Storage, directory: str) -> tuple[bool, list[str]]:
    """``(whether directory provably is a shardkit save's, the names in it)``; a missing one is not.

    Proof: :func:`proves_owned`, or a ``metadata.json`` that reads as shardkit's
    format (saves committed before the mark existed). Another tool's
    ``metadata.json`` proves nothing.
    """
    try:
        names = storage.listdir(directory)
    except FileNotFoundError:
        return False, []
    if proves_owned(names):
        return True, names
    if METADATA_FILE not in names:
        return False, names
    try:
        read_manifest(storage, directory)
    except MetadataError:
        return False, names
    return True, names


def sample_names(names, limit: int = 5) -> str:
    """A few of ``names``, sorted, for a message: ``a, b and 3 more``."""
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")

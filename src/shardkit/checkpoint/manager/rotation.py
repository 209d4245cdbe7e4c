"""``CheckpointManager``'s step names and rotation: which steps go, and how one is removed.

Pure policy apart from the files: :func:`steps_to_remove` decides from step
numbers alone; :func:`remove_step_dir` does the deleting (its commit file
first), :func:`remove_own_files` only shardkit's files where someone added others. What it does not do: list, read or lock anything (the manager
does, on rank 0).

Example::

    steps_to_remove([1, 2, 3, 4, 5], complete=[1, 2, 4, 5], keep_last=2, best=1, writing=None)   # [2, 3]
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

from shardkit.checkpoint.format.manifest import METADATA_FILE, file_records, read_manifest
from shardkit.checkpoint.format.ownership import foreign_names, is_own_name, sample_names
from shardkit.errors import IncompleteCheckpointError, MetadataError
from shardkit.storage import Storage, is_temp_name

__all__ = ["STEP_DIR", "step_dir_name", "steps_to_remove", "remove_step_dir", "remove_own_files", "remove_step",
           "save_problem", "own_step_complete", "NOT_COMPLETE"]

#: ASCII digits, no leading zero, nothing after: one name per step (``step_dir_name``).
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,17})")


#: What the completeness check raises for a step that is not there or not complete (a missing
#: directory or file is a ``FileNotFoundError``: ``MissingShardError`` is one). Anything else (a
#: server's 500, a dropped connection, EACCES) says nothing about the step and is raised.
NOT_COMPLETE = (IncompleteCheckpointError, MetadataError, FileNotFoundError)


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def steps_to_remove(all_steps: list[int], complete: list[int], *, keep_last: int, best: int | None,
                    writing: int | None) -> list[int]:
    """The steps a rotation deletes, ascending: complete ones beyond the ``keep_last`` newest (never
    ``best``), and incomplete ones older than the newest complete step (crashed saves); never the
    newest complete step or the step being written. Nothing while no step is complete."""
    if not complete:
        return []
    keep = set(complete[-keep_last:]) | {complete[-1]} | ({best} if best is not None else set())
    return [s for s in sorted(all_steps)
            if s not in keep and s != writing and (s in complete or s < complete[-1])]


def remove_step_dir(storage: Storage, path: str, *, keep_locks: bool = False) -> None:
    """Delete a step's every file (object: data, temporaries, incomplete uploads), ``metadata.json`` first.

    Withdrawing the commit first makes a deletion cut short read as
    incomplete, never as a checkpoint with missing data. ``keep_locks``: the
    caller holds the step's writer lock, which must stay.
    """
    with contextlib.suppress(FileNotFoundError):
        storage.remove(storage.join(path, METADATA_FILE))
    if keep_locks:
        storage.clear_directory(path)
    else:
        storage.remove_tree(path)


def remove_own_files(storage: Storage, path: str, *, keep: list[str]) -> None:
    """Delete only the files a shardkit save writes in ``path`` (``metadata.json`` first), leaving
    ``path`` and the names in ``keep`` (what someone else put there) as they are."""
    with contextlib.suppress(FileNotFoundError):
        storage.remove(storage.join(path, METADATA_FILE))
    for name in storage.listdir(path):
        if name in keep or not is_own_name(name):
            continue
        entry = storage.join(path, name)
        with contextlib.suppress(FileNotFoundError):
            if is_temp_name(name) and storage.isdir(entry):   # a directory built under a temporary name
                storage.remove_tree(entry)
            else:
                storage.remove(entry)



def remove_step(storage: Storage, path: str) -> list[str]:
    """Delete an owned step's directory, or only shardkit's files in it where someone added others;
    return those others (kept), sorted."""
    foreign = foreign_names(storage.listdir(path))
    if foreign:
        remove_own_files(storage, path, keep=foreign)
    else:
        remove_step_dir(storage, path)
    return foreign


def save_problem(storage: Storage, root: str, step: int, newer: list[int],
                 is_complete: Callable[[int], bool]) -> list[str] | None:
    """``[kind, message]`` where saving ``step`` under ``root`` could cost what is there, else None.

    ``newer``: the step numbers listed under ``root`` that are ``>= step``,
    descending. ``foreign``: ``step``'s directory holds files no shardkit save
    writes (they would be cleared). ``exists``: ``step`` is saved complete (it
    would be cleared before the new copy is written). ``newer``: a newer step
    is complete (rotation, by number, would delete ``step`` first, and
    ``restore()`` would pick the newer one: the run after a roll-back).
    """
    path = storage.join(root, step_dir_name(step))
    try:
        foreign = foreign_names(storage.listdir(path))
    except FileNotFoundError:
        foreign = []
    if foreign:
        return ["foreign", f"{path} holds files shardkit did not write ({sample_names(foreign)}): saving step "
                           f"{step} would clear them first. Nothing was written and nothing removed. Save under "
                           f"another step, move those files, or use another root"]
    for other in newer:
        if not is_complete(other):
            continue
        if other == step:
            return ["exists", f"step {step} is already saved, complete, in {path}; saving it again would clear "
                              f"it before the new copy is written, and a crash then would lose it. Nothing was "
                              f"written. Save under the next step (restore() returns the step it restored: go on "
                              f"from the one after it), or remove {path} first"]
        return ["newer", f"step {other} is saved under {root}, newer than step {step}: rotation keeps the highest "
                         f"steps and would delete step {step}, and restore() would pick step {other}. Nothing was "
                         f"written. After rolling back to an older step, remove the newer step directories first "
                         f"(or save into a new root)"]
    return None


def own_step_complete(storage: Storage, path: str) -> bool:
    """Whether ``path`` holds shardkit's checkpoint, committed, every data file at its recorded size.

    False only for what :data:`NOT_COMPLETE` names; any other failure to read is raised.
    """
    try:
        m = read_manifest(storage, path)
        records = file_records(storage, path, m)
        return all(storage.size_bytes(storage.join(path, f)) == r.bytes for f, r in records.items())
    except NOT_COMPLETE:
        return False

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

from shardkit.checkpoint.format.manifest import METADATA_FILE, Manifest, file_records, read_manifest
from shardkit.checkpoint.format.references import data_path
from shardkit.checkpoint.format.ownership import foreign_names, is_own_name, sample_names
from shardkit.errors import IncompleteCheckpointError, MetadataError
from shardkit.storage import Storage, is_temp_name

__all__ = ["STEP_DIR", "step_dir_name", "steps_to_remove", "remove_step_dir", "remove_own_files", "remove_step",
           "save_problem", "own_step_complete", "NOT_COMPLETE", "referenced_steps", "keep_referenced",
           "steps_since_full", "choose_base", "check_rotation_options"]

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


#: How the functions here read a step's manifest: ``read_manifest``, or a ``ManifestCache``'s ``read``.
ReadManifest = Callable[[Storage, str], Manifest]


def own_step_complete(storage: Storage, path: str, *, read: ReadManifest = read_manifest) -> bool:
    """Whether ``path`` holds shardkit's checkpoint, committed, every data file at its recorded size.

    False only for what :data:`NOT_COMPLETE` names; any other failure to read is raised.
    """
    try:
        m = read(storage, path)
        records = file_records(storage, path, m)
        return all(storage.size_bytes(data_path(storage, path, f)) == r.bytes for f, r in records.items())
    except NOT_COMPLETE:
        return False


def referenced_steps(storage: Storage, root: str, steps: list[int], *,
                     read: ReadManifest = read_manifest) -> set[int]:
    """The steps whose files the checkpoints of ``steps`` (under ``root``) reference: their bases
    (format version 3; chains are flattened, so no closure is needed). A step that is gone or
    incomplete references nothing; any other failed read is raised (the rotation then deletes nothing)."""
    out: set[int] = set()
    for step in steps:
        try:
            m = read(storage, storage.join(root, step_dir_name(step)))
        except NOT_COMPLETE:
            continue
        out.update(int(match.group(1)) for match in map(STEP_DIR.fullmatch, m.base_dirs()) if match)
    return out


def keep_referenced(storage: Storage, root: str, remove: list[int], complete: list[int],
                    needed: tuple[int, ...] = (), *, read: ReadManifest = read_manifest) -> list[int]:
    """``remove`` less every step a kept complete step references (and ``needed``: the base of a save
    in flight): a step is freed only once no kept step reads from it.

    >>> keep_referenced(store, "/ckpt", remove=[0, 1], complete=[0, 1, 2])   # step-2 references step-0
    [1]
    """
    kept = [s for s in complete if s not in remove]
    referenced = referenced_steps(storage, root, kept, read=read) | set(needed)
    return [s for s in remove if s not in referenced]


def steps_since_full(storage: Storage, root: str, newest_first: list[int], limit: int, *,
                     read: ReadManifest = read_manifest) -> int:
    """How many of ``newest_first`` (complete steps) are incremental before the newest full one
    (one without bases); stops counting at ``limit``."""
    count = 0
    for step in newest_first[:limit]:
        if not read(storage, storage.join(root, step_dir_name(step))).bases:
            return count
        count += 1
    return count


def check_rotation_options(keep_last, full_every) -> None:
    """Refuse a ``keep_last`` or ``full_every`` a manager cannot work with (:class:`MetadataError`)."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise MetadataError(f"keep_last must be an integer >= 1 (the newest complete step is always kept), "
                            f"got {keep_last!r}")
    if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
        raise MetadataError(f"full_every must be None or an integer >= 1 (1: every save is full), got "
                            f"{full_every!r}")


def choose_base(storage: Storage, root: str, own_newest_first: list[int], full_every: int | None, *,
                read: ReadManifest = read_manifest) -> int | None:
    """The base of an incremental save: the newest of ``own_newest_first`` (complete steps the manager
    wrote), or None (save in full) when there is none or ``full_every - 1`` incremental steps follow
    the newest full one."""
    if not own_newest_first:
        return None
    if full_every is not None and steps_since_full(storage, root, own_newest_first, full_every,
                                                   read=read) >= full_every - 1:
        return None
    return own_newest_first[0]

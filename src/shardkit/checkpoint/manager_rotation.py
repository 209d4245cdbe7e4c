"""``CheckpointManager``'s step names and rotation: which steps go, and how one is removed.

Pure policy apart from the files: :func:`steps_to_remove` decides from step
numbers alone; :func:`remove_step_dir` does the deleting (its commit file
first). What it does not do: list, read or lock anything (the manager
does, on rank 0).

Example::

    steps_to_remove([1, 2, 3, 4, 5], complete=[1, 2, 4, 5], keep_last=2, best=1, writing=None)   # [2, 3]
"""

from __future__ import annotations

import contextlib
import re

from shardkit.checkpoint.manifest import METADATA_FILE
from shardkit.storage import Storage, is_temp_name

__all__ = ["STEP_DIR", "step_dir_name", "owned_name", "steps_to_remove", "remove_step_dir"]

#: ASCII digits, no leading zero, nothing after: one name per step (``step_dir_name``).
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,17})")


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def owned_name(name: str) -> bool:
    """Whether an entry directly under the root is a manager's: a step directory, or a temporary name."""
    return bool(STEP_DIR.fullmatch(name)) or is_temp_name(name)


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

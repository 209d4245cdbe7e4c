"""What a CLI path argument points at, checked before anything is opened.

``checkpoint_kind(path)`` says whether ``path`` is a distributed checkpoint
(``metadata.json``, or rank files of a save that never finished) or a Hugging
Face one (an index or a single weights file), and raises :class:`InputError`
(exit code 2) for a missing path, a file, a directory that holds no
checkpoint at all, or a checkpoint file that is not a regular file (a FIFO
would block the reader forever). It reads no file contents.

Example::

    kind = checkpoint_kind("ckpt/step-100")      # "distributed" or "hf"
"""

from __future__ import annotations

import os

__all__ = ["InputError", "checkpoint_kind", "DISTRIBUTED", "HF"]

DISTRIBUTED = "distributed"
HF = "hf"


class InputError(Exception):
    """Bad usage or input: the path is missing, unreadable, or not a checkpoint (exit code 2)."""


def checkpoint_kind(path: str) -> str:
    """``"distributed"`` or ``"hf"`` for the checkpoint directory ``path``; ``InputError`` otherwise."""
    from shardkit.hf.directory import get_checkpoint_metadata
    from shardkit.hf.untrusted import non_regular_problems
    from shardkit.storage import storage_for

    if "://" in path and not path.startswith("file://"):
        return HF if _remote_is_hf(path) else DISTRIBUTED
    local = path[len("file://"):] if path.startswith("file://") else path
    if not os.path.exists(local):
        raise InputError(f"{path} does not exist; pass a checkpoint directory")
    if not os.path.isdir(local):
        raise InputError(f"{path} is not a directory; pass the checkpoint directory, not a file in it")
    if not os.access(local, os.R_OK | os.X_OK):
        raise InputError(f"{path} cannot be read (permission denied)")
    store, root = storage_for(local)
    not_files = non_regular_problems(store, root)
    if not_files:
        more = f" (and {len(not_files) - 1} more)" if len(not_files) > 1 else ""
        raise InputError(not_files[0] + more)
    meta = get_checkpoint_metadata(local)
    if meta is not None:
        return DISTRIBUTED if meta.distributed else HF
    if any(n.startswith("rank_") for n in os.listdir(local)):
        return DISTRIBUTED  # rank files without metadata.json: a save that never finished
    raise InputError(
        f"{path} is not a checkpoint: it has no metadata.json (distributed), "
        f"model.safetensors[.index.json] or pytorch_model.bin[.index.json] (Hugging Face)"
    )


def _remote_is_hf(path: str) -> bool:
    from shardkit.hf.directory import get_checkpoint_metadata

    meta = get_checkpoint_metadata(path)
    return meta is not None and not meta.distributed

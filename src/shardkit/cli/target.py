"""What a CLI path argument points at, checked before anything is opened.

``checkpoint_kind(path)`` says whether ``path`` is a distributed checkpoint
(``metadata.json``, or rank files of a save that never finished), a Hugging
Face one (an index or a single weights file) or a PyTorch DCP one
(``.metadata``, or ``.distcp`` files of a save that never finished), and
raises :class:`InputError` (exit code 2) for a missing path, a file, a
directory that holds no checkpoint at all, or a checkpoint file that is not a
regular file (a FIFO would block the reader forever). The kind, and the
order that decides a directory holding two formats, are the one detector's
(:mod:`shardkit.format_detect`, which every reader asks); a URL (``s3://``,
``memory://``) is asked of its store there too. It reads no file contents.

Example::

    kind = checkpoint_kind("ckpt/step-100")      # "distributed", "hf" or "dcp"
"""

from __future__ import annotations

import os
import stat

from shardkit.errors import InputError
from shardkit.format_detect import DCP, DISTRIBUTED, HF, KIND_NAMES, describe_names, find_format, format_of_names

__all__ = ["checkpoint_kind", "check_from", "DISTRIBUTED", "HF", "DCP"]


#: Entries a reader would open: each must be a regular file.
_READ_SUFFIXES = (".json", ".safetensors", ".bin")
_DCP_NAME = ".metadata"


def checkpoint_kind(path: str) -> str:
    """``"distributed"``, ``"hf"`` or ``"dcp"`` for the checkpoint directory ``path``; ``InputError`` otherwise.

    Local checks use only ``os`` calls (no torch import), so bad input fails fast.
    """
    if "://" in path and path[:5].lower() != "file:":
        return _remote_kind(path)
    local = _local_path(path)
    if not os.path.exists(local):
        raise InputError(f"{path} does not exist; pass a checkpoint directory")
    if not os.path.isdir(local):
        raise InputError(f"{path} is not a directory; pass the checkpoint directory, not a file in it")
    try:
        names = set(os.listdir(local))
    except OSError as e:
        raise InputError(f"{path} cannot be listed ({e.strerror})") from e
    _require_regular_files(local, sorted(n for n in names if n.endswith(_READ_SUFFIXES) or n == _DCP_NAME))
    found = format_of_names(names)  # the one detector's order; data files without a marker: that kind,
    if found is not None:           # whose reader then says the save never finished
        return found.kind
    raise InputError(
        f"{path} is not a checkpoint: {describe_names(names)}; a checkpoint has metadata.json (distributed), "
        f"model.safetensors[.index.json] or pytorch_model.bin[.index.json] (Hugging Face), "
        f"or .metadata (PyTorch DCP)"
    )


def _require_regular_files(directory: str, names: list[str]) -> None:
    bad = []
    for name in names:
        try:
            mode = os.stat(os.path.join(directory, name)).st_mode
        except OSError as e:
            bad.append(f"{name} ({e.strerror})")
            continue
        if not stat.S_ISREG(mode):
            bad.append(f"{name} ({_kind(mode)})")
    if bad:
        raise InputError(
            f"{directory} holds {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} that cannot be read as a "
            f"checkpoint file: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; a checkpoint holds only "
            f"regular files (a FIFO would block the reader forever). Remove or restore them."
        )


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _remote_kind(path: str) -> str:
    """The kind the one detector finds on the store (as ``diff`` opens it); where it finds none,
    ``"distributed"``: the distributed reader then says what is missing (``metadata.json`` of a save
    that never finished)."""
    found = find_format(path)
    return found.kind if found is not None else DISTRIBUTED


def _local_path(path: str) -> str:
    """``path``, or the local path a ``file:`` URL names."""
    if path[:5].lower() != "file:":
        return path
    from shardkit.storage.backends.choose import file_url_path  # storage_for's own reading of it (imports torch)

    return file_url_path(path)


#: What each kind needs in a directory, in words.
_KIND_FILES = {
    DISTRIBUTED: "metadata.json or rank_*.safetensors",
    HF: "model.safetensors, model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json",
    DCP: ".metadata or *.distcp",
}


def check_from(src: str, from_kind: str, found_kind: str) -> None:
    """``InputError`` (exit 2) when the local directory ``src``, detected as ``found_kind``, holds none of
    ``from_kind``'s files.

    A directory holding two formats (a DCP save beside ``model.safetensors``) is detected as one of them;
    ``--from`` then picks the other, so only a format with no file of its own there is refused.
    """
    if any(found.kind == from_kind for n in os.listdir(_local_path(src)) for found in [format_of_names([n])] if found):
        return
    raise InputError(f"{src} holds a {KIND_NAMES[found_kind]} checkpoint, not a {KIND_NAMES[from_kind]} one "
                     f"(it has no {_KIND_FILES[from_kind]}); pass --from {found_kind}, or leave --from out to "
                     f"detect it")

"""References to a base checkpoint's files (format version 3, incremental saves): names, paths, identity.

An incremental checkpoint stores only the chunks that changed since its
base; every other chunk names a file of a sibling checkpoint directory (the
one that really holds the bytes: chains are flattened, so step 20 names step
0's file, never step 10's). Inside shardkit such a chunk's file is the *key*
``"<sibling dir>/<file>"`` (one ``/``; an own file's key has none), so the
rest of the read path (records, open files, plans) works on keys unchanged.
This module turns keys into paths, checks sibling names, and proves that a
base is still the checkpoint that was referenced (the SHA-256 of its
``metadata.json``, recorded as the base's ``save_id``). It does not decide
what is unchanged (``incremental.py``) nor parse JSON (``manifest.py``).

Example::

    key = base_key("step-0", "rank_1.safetensors")        # "step-0/rank_1.safetensors"
    data_path(store, "/ckpt/step-20", key)                 # "/ckpt/step-0/rank_1.safetensors"
    check_base(store, "/ckpt/step-20", Base("step-0", sid))  # MissingBaseError when gone or replaced
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shardkit import knobs
from shardkit.errors import MetadataError, MissingBaseError
from shardkit.storage import FileRecord, Storage, check_relative_name
from shardkit.storage.json_io import expect_dict, expect_list, expect_str, short_repr

__all__ = ["Base", "parse_bases", "base_file_key", "base_key", "split_key", "data_path", "parent_dir", "dir_name",
           "check_base_name", "check_base", "metadata_save_id", "SAVE_ID_PREFIX"]

#: A base's identity: the digest of its committed ``metadata.json``.
SAVE_ID_PREFIX = "sha256:"
_METADATA_FILE = "metadata.json"


@dataclass(frozen=True)
class Base:
    """A sibling checkpoint directory some chunks reference: its name and its ``metadata.json`` digest."""

    dir: str
    save_id: str


def base_key(base_dir: str, file: str) -> str:
    """The key of ``file`` of sibling ``base_dir`` (an own file's key is its plain name)."""
    return f"{base_dir}/{file}"


def split_key(key: str) -> tuple[str | None, str]:
    """``(sibling dir or None, file name)`` of a key: ``split_key("step-0/rank_0.safetensors")``."""
    if "/" in key:
        base_dir, file = key.split("/", 1)
        return base_dir, file
    return None, key


def parent_dir(directory: str) -> str:
    """The directory holding ``directory`` (local path or URL), where its siblings are."""
    d = directory.rstrip("/")
    return d.rsplit("/", 1)[0] if "/" in d else "."


def dir_name(directory: str) -> str:
    """The last part of ``directory`` (local path or URL): the name its siblings' references use."""
    return directory.rstrip("/").rsplit("/", 1)[-1]


def data_path(storage: Storage, directory: str, key: str) -> str:
    """The path of the data file ``key`` of the checkpoint in ``directory`` (own or a sibling's)."""
    base_dir, file = split_key(key)
    if base_dir is None:
        return storage.join(directory, file)
    return storage.join(parent_dir(directory), base_dir, file)


def check_base_name(name: object, source: str) -> str:
    """``name`` if it is one plain path component (a sibling directory's name), else :class:`MetadataError`."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or ":" in name):
        raise MetadataError(f"{source} names the base checkpoint {name!r}; a base is one sibling directory's "
                            f"name (no '/', '\\', ':', '.' or '..'). The file may be corrupt or hostile: do not "
                            f"load it")
    return name


def metadata_save_id(data: bytes) -> str:
    """The identity of a checkpoint whose ``metadata.json`` holds ``data`` (what references record)."""
    return SAVE_ID_PREFIX + hashlib.sha256(data).hexdigest()


def check_base(storage: Storage, directory: str, base: Base) -> None:
    """Raise :class:`MissingBaseError` unless sibling ``base.dir`` still holds the very checkpoint that
    ``directory`` references (same ``metadata.json`` bytes). One small read; no data file is opened."""
    path = storage.join(parent_dir(directory), base.dir, _METADATA_FILE)
    fix = (f"{directory} is an incremental checkpoint: it stores only what changed since {base.dir} and reads "
           f"the rest from there. Restore {base.dir} (or load an earlier, complete checkpoint)")
    try:
        data = storage.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES)
    except FileNotFoundError as e:
        raise MissingBaseError(f"the base checkpoint {base.dir} is missing ({path} is not there). {fix}") from e
    if metadata_save_id(data) != base.save_id:
        raise MissingBaseError(f"the base checkpoint {base.dir} was replaced: its metadata.json is not the one "
                               f"referenced ({metadata_save_id(data)}, expected {base.save_id}). {fix}")


def parse_bases(source: str, raw, files: dict[str, FileRecord], fix: str) -> list[Base]:
    """A ``metadata.json``'s ``bases`` (each sibling's name, ``save_id`` and file records), checked; the
    records go into ``files`` under their keys (``"<dir>/<file>"``), so every referenced byte is verified
    like an own one. ``fix``: what the error messages tell the user to do. ``[]`` when there is none."""
    if raw is None:
        return []
    bases: list[Base] = []
    for i, entry in enumerate(expect_list(raw, f"{source}: bases", max_items=knobs.MAX_NUM_RANKS)):
        what = f"{source}: bases[{i}]"
        entry = expect_dict(entry, what)
        base_dir = check_base_name(entry.get("dir"), what)
        if base_dir in {b.dir for b in bases}:
            raise MetadataError(f"{what} names {base_dir!r} a second time. {fix}")
        bases.append(Base(base_dir, expect_str(entry.get("save_id"), f"{what}: save_id")))
        for f, r in expect_dict(entry.get("files") or {}, f"{what}: files").items():
            name = check_relative_name(f, (".safetensors",), source=what)
            if "/" in name:
                raise MetadataError(f"{what} lists the file {name!r}; a base's files are plain names. {fix}")
            files[base_key(base_dir, name)] = FileRecord.from_json(f, r)
    return bases


def base_file_key(source: str, file, base, bases: list[Base], files: dict[str, FileRecord], fix: str) -> str:
    """The key (``"<dir>/<file>"``) of a chunk's file in base number ``base``, checked against ``bases``
    and the records ``files`` holds for them."""
    if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base < len(bases):
        raise MetadataError(f"{source} places a chunk in base {short_repr(base)}; the file lists "
                            f"{len(bases)} bases (indexes 0..{len(bases) - 1}). {fix}")
    key = base_key(bases[base].dir, check_relative_name(file, (".safetensors",), source=source))
    if key not in files:
        raise MetadataError(f"{source} places a chunk in {file!r} of base {bases[base].dir!r}, which its bases "
                            f"entry does not record. {fix}")
    return key

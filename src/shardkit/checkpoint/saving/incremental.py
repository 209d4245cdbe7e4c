"""Incremental saves: read the base checkpoint, prove which chunks are unchanged since it, write the rest.

A chunk this rank writes is *unchanged* when the base stores a chunk of the
same tensor with the same box, dtype and full shape, and the bytes the base
file holds there are equal, byte for byte, to the bytes about to be written
(``byte_proof.py``: libc ``memcmp`` against one map of each base file, split
evenly over the I/O threads, stopping at the first difference). Nothing
weaker counts: no hash, no version counter, no ``requires_grad`` flag. An unchanged chunk is then referenced, not written:
its entry names the file that really holds the bytes (the base's own file,
or, the chain flattened, the file the base itself references), with that
file's record (size, block checksums) copied, so loads verify it as any
other. What it does not do: split a changed chunk into bands (a chunk is
written whole or referenced whole), choose the file's layout (the caller's
``write`` does), or decide which base (the caller names it;
``CheckpointManager(incremental=True)`` takes its newest complete step).

Example::

    view = read_base(store, "/ckpt/step-20", "/ckpt/step-10")
    written, refs = write_changed(store, "/ckpt/step-20", view, {"w": (full_shape, box)}, {"w": w},
                                  write=lambda named: write_data_file(store, "/ckpt/step-20", 0, 1, named))
    # refs == {"w": ["step-0/rank_0.safetensors", 80, 4176]} where w's bytes equal step 0's
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from shardkit import knobs
from shardkit.checkpoint.format.manifest import METADATA_FILE, Manifest, file_records, parse_manifest
from shardkit.checkpoint.format.compact_manifest import GridChunks
from shardkit.checkpoint.format.references import (
    Base, base_key, data_path, dir_name, metadata_save_id, parent_dir, split_key,
)
from shardkit.checkpoint.saving.byte_proof import ByteProof, Candidate
from shardkit.dtypes import to_safetensors_name
from shardkit.errors import MetadataError, MissingShardError
from shardkit.layout import Box
from shardkit.storage import FileRecord, Reader, Storage, read_header, run_parallel, storage_for

__all__ = ["BaseView", "read_base", "check_sibling", "write_changed", "used_bases", "base_directory"]


@dataclass
class BaseView:
    """The base of an incremental save, as the new checkpoint sees it.

    ``records`` and ``chunks`` are keyed as the new checkpoint names files
    (``"<sibling>/<file>"``); ``bases`` are every sibling those keys may name,
    with the identity each must keep (the base itself and the bases it
    references)."""

    name: str
    save_id: str
    manifest: Manifest
    records: dict[str, FileRecord]
    bases: dict[str, Base]

    def key_of(self, base_file_key: str) -> str:
        """A file key of the base's manifest, as seen from the new checkpoint (chains flattened)."""
        return base_file_key if "/" in base_file_key else base_key(self.name, base_file_key)


def check_sibling(storage: Storage, directory: str, base_directory: str) -> str:
    """The name of ``base_directory`` if it is a sibling of ``directory`` (same parent, another name),
    else :class:`MetadataError`: references name a base relative to the checkpoint's parent."""
    name = dir_name(base_directory)
    same_parent = storage.same_path(parent_dir(base_directory)) == storage.same_path(parent_dir(directory))
    if not same_parent or storage.same_path(base_directory) == storage.same_path(directory) or not name \
            or name in (".", ".."):
        raise MetadataError(f"base={base_directory!r} cannot be the base of a save into {directory!r}: the base "
                            f"must be another checkpoint directory beside it (same parent folder or prefix), so "
                            f"the reference survives moving the parent. Save into a sibling of the base")
    return name


def read_base(storage: Storage, directory: str, base_directory: str) -> BaseView:
    """Read the committed checkpoint ``base_directory`` (a sibling of ``directory``) for an incremental save.

    Raises :class:`MissingShardError` / :class:`IncompleteCheckpointError` when the base is missing or
    incomplete, :class:`MetadataError` when it is no sibling. Reads ``metadata.json`` only."""
    name = check_sibling(storage, directory, base_directory)
    path = storage.join(base_directory, METADATA_FILE)
    if not storage.exists(path):
        raise MissingShardError(f"the base checkpoint {base_directory} has no {METADATA_FILE} (missing, or a save "
                                f"that never finished): an incremental save needs a complete base. Save in full, "
                                f"or name a complete checkpoint as the base")
    data = storage.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES)
    m = parse_manifest(path, data)
    save_id = metadata_save_id(data)
    records = {}
    for key, record in file_records(storage, base_directory, m).items():
        records[base_key(name, key) if "/" not in key else key] = record
    bases = {b.dir: b for b in m.bases}
    bases[name] = Base(name, save_id)
    return BaseView(name, save_id, m, records, bases)


def _base_chunk(view: BaseView, name: str, full_shape: tuple[int, ...], box: Box, t: torch.Tensor):
    """``(file key, begin, end)`` of the base's chunk of ``name`` with exactly ``box`` (begin and end as
    the manifest records them, None for a grid entry's chunk), or None when the base has no such chunk."""
    saved = view.manifest.tensors.get(name)
    if saved is None or saved.chunks is None or tuple(saved.spec.full_shape) != tuple(full_shape):
        return None
    if saved.dtype != to_safetensors_name(t.dtype):
        return None
    want = (tuple(box.offsets), tuple(box.sizes))
    if isinstance(saved.chunks, GridChunks):      # found without expanding the grid; its header has the range
        match = next(((f, None, None) for f, b, _ in saved.chunks.overlapping(box)
                      if (tuple(b.offsets), tuple(b.sizes)) == want), None)
    else:
        match = next(((c.file, c.begin, c.end) for c in saved.chunks if (c.offsets, c.sizes) == want), None)
    if match is None:
        return None
    key = view.key_of(match[0])
    return (key, *match[1:]) if key in view.records else None


def _header_range(reader: Reader, headers: dict, key: str, record: FileRecord, name: str, box: Box,
                  t: torch.Tensor):
    """``(begin, end)`` of tensor ``name`` in the base file open in ``reader``, from its header (read
    once per file, checked by ``record``'s header checksum where it has one), or None unless the entry
    has ``box``'s shape and ``t``'s dtype."""
    if key not in headers:
        headers[key] = read_header(reader, record)
    entry = headers[key].tensors.get(name)
    if entry is None or tuple(entry.shape) != tuple(box.sizes) or entry.dtype != to_safetensors_name(t.dtype):
        return None
    return entry.begin, entry.end


def _split_proven(found: list, proven: dict[str, tuple[str, str]], view: BaseView) -> tuple[list, list]:
    """``found`` (``(candidate, file key)``) split into those ``proven`` already vouches for (the same file
    key, recorded with the same checksum in the base read now) and those still to compare."""
    known, rest = [], []
    for c, key in found:
        (known if proven.get(c.name) == (key, view.records[key].checksum) else rest).append((c, key))
    return known, rest


def write_changed(storage: Storage, directory: str, view: BaseView, boxes: dict[str, tuple[tuple[int, ...], Box]],
                  to_write: dict, write: Callable[[list], dict], *, proven: dict[str, tuple[str, str]] | None = None
                  ) -> tuple[dict, dict[str, list]]:
    """Write the tensors of ``to_write`` whose bytes are not proven equal to the base's, with ``write``
    (``named -> result``, publishing one file atomically); return ``(write's result, refs)``, ``refs``
    being ``name -> [file key, begin, end]`` for each tensor referenced instead (box ``boxes[name]``).

    Overlapped: a first piece of each candidate is compared (``ByteProof.probe``), then the file of
    what differed there is written while the rest is compared, on the shared I/O threads. Should the
    rest show another difference (one past a tensor's first piece), the file is written again, whole,
    with that tensor too, before this returns: ``write``'s last result is always the file of exactly
    the tensors absent from ``refs``, and until the caller commits nothing names it. A tensor that is
    not a plain ``torch.Tensor`` (a lazy one) or has no element is written, never compared.

    ``proven``: ``name -> (file key, file record checksum)`` of tensors already proven equal to the
    bytes at that place (``checkpoint.background.staged_proof``). Such a tensor is referenced without
    a comparison only where the base keeps its chunk in that very file, recorded with that very
    checksum (the base read now is the checkpoint the proof was made against); else it is compared."""
    readers: dict[str, Reader] = {}
    proof = None
    try:
        found = _candidates(storage, directory, view, boxes, to_write, readers)
        proven = proven or {}
        known, found = _split_proven(found, proven, view)
        proof = ByteProof([c for c, _ in found], digest_first=not storage.renames_directories)
        proof.probe()
        early = {found[i][0].name for i in proof.changed()}
        compared = {c.name for c, _ in found + known}
        first = [(n, t) for n, t in to_write.items() if n not in compared or n in early]
        result: dict = {}
        run_parallel([lambda: result.__setitem__("written", write(first)), *proof.jobs()])
        equal = [found[i] for i in proof.equal()] + known
        refs = {c.name: [key, c.begin, c.end] for c, key in equal}
        if len(refs) + len(first) < len(to_write):     # a difference past a first piece: write it too
            result["written"] = write([(n, t) for n, t in to_write.items() if n not in refs])
        return result["written"], refs
    finally:
        if proof is not None:
            proof.close()
        for reader in readers.values():
            reader.close()


def _candidates(storage: Storage, directory: str, view: BaseView, boxes: dict, to_write: dict,
                readers: dict[str, Reader]) -> list[tuple[Candidate, str]]:
    """``(candidate, file key)`` for each tensor of ``to_write`` the base holds a chunk of with the same
    box, dtype, full shape and byte count; each base file opened once into ``readers`` and checked to
    have its recorded size (:class:`MetadataError` otherwise: a damaged base)."""
    headers: dict = {}
    out = []
    for name, t in to_write.items():
        if name not in boxes or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        full_shape, box = boxes[name]
        found = _base_chunk(view, name, full_shape, box, t)
        if found is None:
            continue
        key, begin, end = found
        if key not in readers:
            readers[key] = storage.open_reader(data_path(storage, directory, key))
            if readers[key].size_bytes != view.records[key].bytes:
                raise MetadataError(f"{data_path(storage, directory, key)} is {readers[key].size_bytes} bytes, "
                                    f"its base records {view.records[key].bytes}: the base is damaged. Save in "
                                    f"full (no base), then validate the base")
        # The bytes compared are the bytes a load reads: where the base file's own header puts the
        # tensor. A manifest range that disagrees with it (a damaged metadata.json) proves nothing.
        in_header = _header_range(readers[key], headers, key, view.records[key], name, box, t)
        if in_header is None or (begin is not None and (begin, end) != in_header):
            continue
        begin, end = in_header
        if end - begin != math.prod(box.sizes) * t.element_size():
            continue
        out.append((Candidate(name, readers[key], begin, end, t, view.records[key]), key))
    return out


def used_bases(view: BaseView, keys) -> list[Base]:
    """The bases (in the base view's order) whose files ``keys`` name."""
    dirs = {split_key(k)[0] for k in keys}
    return [b for d, b in sorted(view.bases.items()) if d in dirs]


def base_directory(storage: Storage, directory: str, base) -> str:
    """``base`` as its store spells it, checked to be a sibling of ``directory`` on ``storage`` (the save's
    own) before anything is written: a base on another store (a URL beside a local save, a local path
    beside a URL one) has another parent and is refused (:class:`MetadataError`, :func:`check_sibling`)."""
    base_dir = storage_for(base)[1]
    check_sibling(storage, directory, base_dir)
    return base_dir

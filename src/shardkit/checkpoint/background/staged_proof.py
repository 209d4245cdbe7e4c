"""Proving tensors unchanged from the staging buffers of the last background save (incremental saves).

A background save copies this rank's tensors into staging buffers, kept for
the next save, and writes the checkpoint from them. Once that save is
committed, each buffer holds exactly the bytes the checkpoint keeps for its
tensor, at a place the commit fixed: this rank's own file of that directory,
or the file it references. The next incremental save whose base is that
checkpoint compares each tensor with its buffer, in memory, while it stages
(``staging.stage_against``: a piece is copied only where it differs),
instead of with the base file, which ``O_DIRECT`` saves leave out of the
page cache (a read from disk). Equal bytes prove the tensor unchanged since
the base, and it is referenced where the base keeps it. The proof is still a
full byte comparison, only against the buffer instead of the file.

It is sound only while nothing else can have changed either side, so a
tensor counts as proven only when all of these hold (else it is compared
with the base file as before, ``incremental.write_changed``):

- :func:`committed` made the record after ``write_and_commit`` returned on
  this rank (every rank raises when the commit fails), for a save into the
  directory the new save names as its base, by the same rank of the same
  world size;
- the record is dropped as soon as any save starts staging on the same
  background group (:func:`take`), since the buffers are overwritten from
  then on, and a failed save leaves none;
- the buffer the new save stages the tensor into is the very buffer the
  record holds for it (one handed to another save, a reserve's or a new one
  is not), for the same box of the same full shape;
- in the base as the new save reads it, the tensor's chunk is in the file
  the record names, and that file's record (size and block checksums) is
  the one the committed save had: a base saved again since is another one.

What it does not do: prove device (CUDA) tensors (their buffers are pinned
host memory, compared only after a copy), or prove anything for a base that
was not this process's last background save on the group.

Example::

    last = take(key)                               # staging starts: the old record is gone
    proving = comparable(last, prep, storage, buffers)
    staged, used, same = stage_against(prep.to_write, buffers, compare={(n,) for n in proving})
    prep.proven = {path[0]: proving[path[0]].where for path in same}
    ...                                            # written and committed in the background
    keep(key, committed(prep, storage, directory))
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from shardkit.checkpoint.format.manifest import data_file_name
from shardkit.checkpoint.format.references import base_key, dir_name
from shardkit.storage import Storage

__all__ = ["Held", "StagedSave", "committed", "comparable", "take", "keep"]


@dataclass(frozen=True)
class Held:
    """One staging buffer of a committed save: the box it holds, and where the checkpoint keeps those bytes."""

    buffer: torch.Tensor
    box: tuple                 # (full shape, Box), as ``Prepared.boxes`` has it
    where: tuple[str, str]     # (file key seen from a sibling, that file's record checksum)


@dataclass(frozen=True)
class StagedSave:
    """The record of a committed background save whose staging buffers are kept (see the module docstring)."""

    directory: str             # ``storage.same_path`` of the checkpoint directory
    rank: int
    world_size: int
    held: dict[str, Held]


_LOCK = threading.Lock()
_RECORDS: dict[int, StagedSave] = {}     # background group key -> the last committed save on it


def take(key: int) -> StagedSave | None:
    """Remove and return the record kept for background group ``key``: call it when staging starts."""
    with _LOCK:
        return _RECORDS.pop(key, None)


def keep(key: int, record: StagedSave | None) -> None:
    """Keep ``record`` (or drop the one kept, with None) as the last committed save on ``key``."""
    with _LOCK:
        if record is None:
            _RECORDS.pop(key, None)
        else:
            _RECORDS[key] = record


def committed(prep, storage: Storage, directory: str) -> StagedSave | None:
    """The record of ``prep``'s save (a ``Prepared`` whose ``to_write`` are its staging buffers), just
    committed into ``directory``; None when there is nothing to record (no file written)."""
    written = prep.written
    if written is None:
        return None
    own = (base_key(dir_name(directory), data_file_name(prep.rank)), written["record"]["checksum"])
    refs = written.get("refs", {})
    records = prep.base_view.records if prep.base_view is not None else {}
    held = {}
    for tensor_name, buffer in prep.to_write.items():
        if tensor_name not in prep.boxes or not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            continue
        if tensor_name in refs:
            key = refs[tensor_name][0]
            if key not in records:
                continue
            where = (key, records[key].checksum)
        else:
            where = own
        held[tensor_name] = Held(buffer, prep.boxes[tensor_name], where)
    return StagedSave(storage.same_path(directory), prep.rank, prep.world_size, held)


def comparable(last: StagedSave | None, prep, storage: Storage, buffers: dict[tuple, torch.Tensor]
               ) -> dict[str, Held]:
    """The tensors of ``prep`` (an incremental save about to stage into ``buffers``) that its staging may
    prove unchanged against ``last``: name -> the ``Held`` of the buffer it stages into."""
    if last is None or prep.base_dir is None or storage.same_path(prep.base_dir) != last.directory \
            or (last.rank, last.world_size) != (prep.rank, prep.world_size):
        return {}
    out = {}
    for name in prep.to_write:
        held = last.held.get(name)
        if held is not None and buffers.get((name,)) is held.buffer and prep.boxes.get(name) == held.box:
            out[name] = held
    return out

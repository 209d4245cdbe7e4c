"""The chunked save (format version 2): prepare on the caller's thread, then write and commit.

Steps (FORMAT.md invariants 1-3, as ``save_distributed``):

1. :func:`prepare`: flatten the state, find each tensor's box (``dtensor_layout``),
   exchange the boxes (one small JSON all-gather) and plan who writes which
   distinct box once (``chunk_plan``). Every rank fails together on a bad state.
2. :func:`write_and_commit`: rank 0 withdraws an old ``metadata.json``; every
   rank writes ``rank_<r>.safetensors`` with the boxes it was given (possibly
   none) and reports its file record and each entry's byte range; rank 0
   writes ``metadata.json`` (version 2: every tensor by its chunks) last.

Step 2 issues collectives only on the coordinator it is given, so a
background save runs it on a group of its own. With no coordinator (one
process) there is nothing to agree on. This module does not stage tensors.

Example::

    prep = prepare(state, coordinator, rank, world_size, metadata=None)
    write_and_commit(prep, storage, directory, coordinator)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardkit.checkpoint.chunk_plan import ChunkPlan, plan_chunks
from shardkit.checkpoint.chunks import Chunk
from shardkit.checkpoint.dtensor_layout import local_box
from shardkit.checkpoint.group import exchange
from shardkit.checkpoint.manifest import (
    CHUNKED_VERSION, METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, write_json,
)
from shardkit.checkpoint.nested import flatten
from shardkit.checkpoint.rank_state import check_reserved, rank_state_objects, rank_state_report
from shardkit.checkpoint.distributed_save import _attempt, _describe, _raise_first, _user_metadata, _withdraw
from shardkit.checkpoint.spec import TensorShardSpec
from shardkit.dtypes import NAME_TO_DTYPE, itemsize_bytes, to_safetensors_name
from shardkit.errors import TensorMismatchError
from shardkit.storage import FileRecord, Storage, read_header, write_safetensors

__all__ = ["Prepared", "prepare", "write_and_commit"]


@dataclass
class Prepared:
    rank: int
    world_size: int
    plan: ChunkPlan
    to_write: dict[str, torch.Tensor]     # name -> the local tensor this rank writes
    objects: dict[str, Any]
    structure: Any
    user_metadata: dict


_WITHDRAW_STEP = "locking the directory and withdrawing the previous metadata"


def _all(coordinator, value, step: str) -> list:
    return [value] if coordinator is None else exchange(coordinator, value, step)


def _report(state_dict) -> tuple[dict, dict[str, torch.Tensor], Any]:
    flat = flatten(state_dict)
    report, local = {}, {}
    for name, t in flat.tensors.items():
        if name == "__metadata__":
            raise TensorMismatchError("a tensor cannot be named '__metadata__' (safetensors reserves it)")
        box, local[name] = local_box(name, t)
        report[name] = [list(t.shape), to_safetensors_name(t.dtype), list(box.offsets), list(box.sizes)]
    return report, local, flat


def _mine(state_dict, rank_state, rank: int, world_size: int, metadata):
    report, local, flat = _report(state_dict)
    check_reserved([*flat.tensors, *flat.objects])
    extra_report, extra_local, rank_objects = rank_state_report(rank_state, rank, world_size)
    return {**report, **extra_report}, {**local, **extra_local}, flat, rank_objects, _user_metadata(metadata)


def prepare(state_dict, coordinator, rank: int, world_size: int, metadata=None, rank_state=None) -> Prepared:
    """Plan a chunked save; a collective on ``coordinator`` (None: one process). Writes nothing.

    ``rank_state``: per-rank values (``rank_state.py``), stored beside the state."""
    mine, exc = _attempt(lambda: _mine(state_dict, rank_state, rank, world_size, metadata))
    statuses = _all(coordinator, {"error": _describe(exc), "report": mine[0] if mine else None,
                                  "rank_objects": mine[3] if mine else None}, "exchanging the layouts")
    _raise_first(statuses, exc, "preparing the save")
    report, local, flat, _, user_metadata = mine
    plan = plan_chunks([s["report"] for s in statuses], lambda d: itemsize_bytes(NAME_TO_DTYPE[d]))
    to_write = {n: local[n] for n in plan.writes[rank]}
    objects = {**flat.objects, **rank_state_objects(statuses)}
    return Prepared(rank, world_size, plan, to_write, objects, flat.structure, user_metadata)


def _write_file(storage: Storage, directory: str, prep: Prepared) -> dict:
    name = data_file_name(prep.rank)
    path = storage.join(directory, name)
    record = write_safetensors(storage, path, list(prep.to_write.items()),
                               {"format": "pt", "shardkit.rank": str(prep.rank),
                                "shardkit.num_ranks": str(prep.world_size)})
    with storage.open_reader(path) as reader:
        header = read_header(reader)
    ranges = {n: [header.tensors[n].begin, header.tensors[n].end] for n in prep.to_write}
    return {"file": name, "record": record.to_json(), "ranges": ranges}


def _manifest(prep: Prepared, written: list[dict]) -> Manifest:
    tensors = {}
    for name, t in prep.plan.tensors.items():
        chunks = tuple(Chunk(data_file_name(r), box.offsets, box.sizes, *written[r]["ranges"][name])
                       for box, r in sorted(t.box_to_writer.items(), key=lambda br: br[0].offsets))
        tensors[name] = SavedTensor(TensorShardSpec(t.full_shape, None, ()), t.dtype, None, chunks)
    files = {w["file"]: FileRecord.from_json(w["file"], w["record"]) for w in written}
    return Manifest(CHUNKED_VERSION, prep.world_size, tensors, files, prep.objects, prep.structure,
                    prep.user_metadata)


def write_and_commit(prep: Prepared, storage: Storage, directory: str, coordinator,
                     before_write: Callable[[], None] | None = None) -> None:
    """Write this rank's file and, on rank 0, ``metadata.json`` last; collectives on ``coordinator``.

    ``before_write`` runs on rank 0 before anything is touched (the manager
    clears a crashed save's leftovers there); every rank waits for it. Each
    rank holds its writer lock from before the first exchange to the end, so
    a second save into a directory being written fails at once on every rank
    (``CheckpointBusyError``) and touches nothing.
    """
    with contextlib.ExitStack() as held:
        _write_and_commit_locked(prep, storage, directory, coordinator, before_write, held)


def _write_and_commit_locked(prep: Prepared, storage: Storage, directory: str, coordinator,
                             before_write: Callable[[], None] | None, held: contextlib.ExitStack) -> None:
    def withdraw():
        # Locked inside the first step: a busy directory fails every rank before anything is touched.
        held.enter_context(storage.writer_lock(
            directory, slot=prep.rank, holder=f"shardkit.checkpoint.save rank {prep.rank} of {prep.world_size}"))
        if before_write is not None and prep.rank == 0:
            before_write()
        _withdraw(storage, directory, prep.rank)

    _, exc = _attempt(withdraw)
    _raise_first(_all(coordinator, {"error": _describe(exc)}, _WITHDRAW_STEP), exc, _WITHDRAW_STEP)
    written, exc = _attempt(lambda: _write_file(storage, directory, prep))
    statuses = _all(coordinator, {"error": _describe(exc), "written": written}, "writing the data files")
    _raise_first(statuses, exc, "writing the data files")
    exc = None
    if prep.rank == 0:
        manifest_of = lambda: _manifest(prep, [s["written"] for s in statuses])  # noqa: E731
        _, exc = _attempt(lambda: write_json(storage, storage.join(directory, METADATA_FILE),
                                             manifest_to_json(manifest_of())))
    _raise_first(_all(coordinator, {"error": _describe(exc)}, "writing metadata.json"), exc, "writing metadata.json")

"""``save_distributed``: a ``shard_spec`` save, written as format version 3 by the one chunked engine.

``shard_spec`` (a :class:`TensorShardSpec` per sharded tensor: the dimension
and one size per rank) gives every rank's box of every tensor, so each rank
computes the whole chunked plan itself (``plan.spec_chunk_plan``): rank r
writes its box of each sharded tensor, each replicated tensor is written
once, the writers spread by bytes. The files and ``metadata.json`` are the
ones ``save`` writes (``chunked_save``: ``write_and_commit`` with a group,
``write_data_file`` and ``commit`` without). Version 1 is read, never written.

With a group (three rounds, each one gather to rank 0 and one broadcast of
its verdict, ``agreement.agree``): each rank plans and locks its slot
(``Storage.writer_lock``: a second save into a directory being written fails
at once with :class:`CheckpointBusyError`) and the ranks agree on the
layout's digest (a failure or a disagreement fails every rank before
anything is touched); then rank 0 withdraws the old ``metadata.json``; then
every rank writes its file and rank 0 commits ``metadata.json`` last, after
every rank reported its file (``write_and_commit(..., locked=True)``).

Without a group each rank saves alone (several ranks called in one process,
or separate processes): it locks its slot, withdraws the old commit
(``metadata.json``, its own ``rank_<r>.json``), writes
``rank_<r>.safetensors``, then ``rank_<r>.json`` (its file's record and the
save's ``save_id``: a digest of the layout, the plain values, ``metadata`` and
the launcher's attempt), then looks for every other rank's ``rank_<r>.json``
of the same ``save_id``. The rank that finds them all (the last to finish)
writes ``metadata.json`` with every file's record: its presence means the
whole checkpoint is there, as with a group. Two ranks finishing together may
both write it, byte for byte the same.

Overwriting. Saving each step into a fresh directory is the recommended use.
Overwriting in place is crash-safe with a group and with ``world_size == 1``.
Without a group and with several ranks, the ``save_id`` keeps old and new
rank records apart as long as the state carries something that changes
between saves (the step); when it does not and the save is cut short, the
last rank could commit its new file beside another rank's old one. Such a
save is refused with :class:`CheckpointExistsError` before it touches
anything: rank ``r`` refuses when its own ``rank_<r>.json`` or
``rank_<r>.safetensors`` is there (rank 0 also ``metadata.json``), files only
an earlier save can have written. ``overwrite=True`` allows it, with exactly
that risk. Every rank must pass the same plain values and ``metadata``. This
module does not stage tensors for background saving (see ``async_save``).

Example::

    spec = ShardMetadata(2, {"w": TensorShardSpec((8, 4), 0, (4, 4))})
    save_distributed({"w": w_slice, "step": 10}, "/ckpt/step-10", rank, 2, spec, group=pg)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass

import xxhash

from shardkit import knobs

from shardkit.checkpoint.coordination.agreement import FIRST_STEP, agree, attempt, describe
from shardkit.checkpoint.saving.chunked_save import Prepared, commit, snapshot_metadata, withdraw, write_and_commit, \
    write_data_file
from shardkit.checkpoint.coordination.group import resolve_group
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.format.manifest import (
    CHUNKED_VERSION, METADATA_FILE, RANK_FORMAT, data_file_name, rank_manifest_name, write_json,
)
from shardkit.checkpoint.format.nested import flatten
from shardkit.checkpoint.planning.plan import spec_chunk_plan
from shardkit.checkpoint.format.rank_state import check_reserved
from shardkit.checkpoint.format.spec import TensorShardSpec, as_spec_dict, check_local_tensor, check_world
from shardkit.dtypes import NAME_TO_DTYPE, itemsize_bytes, to_safetensors_name
from shardkit.errors import CheckpointExistsError, MetadataError, TensorMismatchError
from shardkit.storage import Storage, parse_json_object, storage_for
from shardkit.storage.fast_io.write_mode import FOREGROUND, WriteMode

__all__ = ["save_distributed", "check_may_overwrite", "report_failed_save"]

log = logging.getLogger("shardkit.checkpoint")

#: Gather slot (group.settle) that fits the layout round's status: an error or a digest.
_STATUS_SLOT_BYTES = 96


@dataclass
class _Planned:
    prep: Prepared
    digest: str      # what every rank must agree on: names, shapes, dtypes, specs
    save_id: str     # ties the rank records of one save without a group


@logged("save_distributed")
def save_distributed(state_dict, dir, rank, world_size, shard_spec, *, group=None, metadata=None,
                     overwrite: bool = False, write_mode: WriteMode | None = None) -> None:
    """Save this rank's part of ``state_dict`` into the checkpoint directory ``dir`` (format version 3).

    ``state_dict`` may be nested; tensors named (by dotted path) in
    ``shard_spec`` are this rank's slices, every other tensor is replicated
    and written once, by one rank. Plain leaves and ``metadata``
    (JSON-serialisable, stored as ``user_metadata``) go into ``metadata.json``.
    It does not return before this rank's files are durable; with a
    ``group``, not before the whole checkpoint is committed; without one,
    the last rank to finish commits it. ``write_mode`` (``storage.fast_io.write_mode.WriteMode``;
    None: a blocking save's) says how local files are written: ``AsyncCheckpointer`` passes
    ``WriteMode.background()``, paced at ``knobs.BACKGROUND_DISK_SHARE`` of the disk's speed.

    Raises :class:`MetadataError` for a bad rank or spec, :class:`TensorMismatchError`
    for a tensor that does not fit its spec, ``TypeError`` for a leaf that
    cannot be saved without pickle.

    >>> save_distributed({"w": torch.ones(4)}, "/tmp/ck", 0, 1, None)
    """
    check_world(rank, world_size)
    coordinator = resolve_group(group, rank, world_size)
    storage, directory = storage_for(dir)
    mode = FOREGROUND if write_mode is None else write_mode
    if coordinator is None:
        planned = _prepare(state_dict, rank, world_size, shard_spec, metadata, mode)
        _save_alone(storage, directory, planned, refuse_existing=world_size > 1 and not overwrite)
    else:
        _save_with_group(storage, directory, coordinator,
                         lambda: _prepare(state_dict, rank, world_size, shard_spec, metadata, mode))


def _prepare(state_dict, rank, world_size, shard_spec, metadata, mode: WriteMode) -> _Planned:
    flat = flatten(state_dict)
    specs = as_spec_dict(shard_spec, world_size)
    for name in specs:
        if name not in flat.tensors:
            what = "a plain value" if name in flat.objects else "not in the state"
            raise TensorMismatchError(f"shard_spec names {name!r}, which is {what}; on rank {rank} the "
                                      f"state's tensors are: {', '.join(sorted(flat.tensors)[:8]) or 'none'}")
    check_reserved([*flat.tensors, *flat.objects])
    tensors = {}
    for name, tensor in flat.tensors.items():
        if name == "__metadata__":
            raise TensorMismatchError("a tensor cannot be named '__metadata__' (safetensors reserves it)")
        spec = specs.get(name) or TensorShardSpec(tuple(tensor.shape), None, ())
        check_local_tensor(name, tuple(tensor.shape), spec, rank, world_size)
        tensors[name] = (spec.full_shape, to_safetensors_name(tensor.dtype))
    plan = spec_chunk_plan(tensors, specs, world_size, lambda d: itemsize_bytes(NAME_TO_DTYPE[d]))
    prep = Prepared(rank, world_size, lambda: plan, {n: flat.tensors[n] for n in plan.writes[rank]},
                    flat.objects, flat.structure, snapshot_metadata(metadata),
                    {n: s.shard_dim for n, s in specs.items() if s.shard_dim is not None},
                    {n: tuple(s.shard_sizes) for n, s in specs.items()
                     if s.shard_dim is not None and math.prod(s.full_shape) == 0}, write_mode=mode)
    digest = _digest(tensors, specs, world_size)
    return _Planned(prep, digest, _save_id(digest, prep))


def _digest(tensors: dict, specs: dict, world_size: int) -> str:
    layout = sorted((n, list(shape), dtype, specs[n].shard_dim if n in specs else None,
                     list(specs[n].shard_sizes) if n in specs else []) for n, (shape, dtype) in tensors.items())
    return xxhash.xxh3_64_hexdigest(json.dumps([world_size, layout]).encode())


#: Set by launchers, equal on every rank of one attempt of a job, different for its restart or requeue.
_ATTEMPT_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")


def _save_id(digest: str, prep: Prepared) -> str:
    # Without a group, ranks cannot agree on a fresh id; the layout plus the plain
    # values and user metadata (equal on every rank) tell one save from another
    # whenever the state carries something that changes, such as the step. The
    # launcher's attempt tells a restarted job's save of a step from the files its
    # killed attempt left of the same step: those never complete the new one.
    attempt_of = {name: os.environ.get(name) for name in _ATTEMPT_ENV}
    text = json.dumps([digest, prep.objects, prep.structure, prep.user_metadata, attempt_of], sort_keys=True,
                      default=str)
    return xxhash.xxh3_64_hexdigest(text.encode())


def _lock(storage: Storage, directory: str, prep: Prepared):
    # One slot per rank: the ranks of one save never block each other, and rank 0's
    # slot is the one an HF save of the same directory takes.
    return storage.writer_lock(directory, slot=prep.rank,
                               holder=f"save_distributed rank {prep.rank} of {prep.world_size}")


def _existing_files(storage: Storage, directory: str, rank: int) -> list[str]:
    # Only what an earlier save can have written: never a faster rank's files of this save.
    names = [rank_manifest_name(rank), data_file_name(rank)] + ([METADATA_FILE] if rank == 0 else [])
    return [n for n in names if storage.exists(storage.join(directory, n))]


def check_may_overwrite(dir, rank: int, world_size: int) -> None:
    """Raise ``CheckpointExistsError`` where a save without a group and without
    ``overwrite`` would refuse ``dir`` (several ranks, this rank's files of an earlier save there).

    For callers that want the refusal before they start (``AsyncCheckpointer``);
    the save itself checks again.
    """
    storage, directory = storage_for(dir)
    if world_size > 1:
        _refuse_existing(storage, directory, rank, world_size)


def _refuse_existing(storage: Storage, directory: str, rank: int, world_size: int) -> None:
    found = _existing_files(storage, directory, rank)
    if found:
        raise CheckpointExistsError(
            f"{directory} already holds {', '.join(found)} from an earlier save; rank {rank} of "
            f"{world_size} saving without a group cannot know that the other ranks replace their files "
            f"too, so a re-save cut short could leave a directory that validates and loads old and new "
            f"shards mixed. Nothing was written. Save each step into a new directory (recommended), pass "
            f"group= so the ranks agree on the overwrite, or pass overwrite=True if a mix cannot happen "
            f"(every rank surely finishes, or the plain values differ, e.g. they hold the step)")


def report_failed_save(dir, rank: int, world_size: int, group, error: BaseException) -> None:
    """This rank could not get its part of a ``save_distributed`` of ``dir`` over ``group`` ready
    (``error``): take part in the save's first exchange with it, so every rank's save raises there
    instead of waiting for this one until the group's timeout. Touches no file; raises ``error``'s
    agreed failure, as the other ranks do."""
    coordinator = resolve_group(group, rank, world_size)
    storage, directory = storage_for(dir)

    def fail():
        raise error

    _save_with_group(storage, directory, coordinator, fail)


def _save_alone(storage: Storage, directory: str, planned: _Planned, *, refuse_existing: bool) -> None:
    prep = planned.prep
    with _lock(storage, directory, prep):
        if refuse_existing:
            _refuse_existing(storage, directory, prep.rank, prep.world_size)
        withdraw(storage, directory, prep.rank, commit=True)   # any rank may be the one that commits
        written = write_data_file(storage, directory, prep.rank, prep.world_size, list(prep.to_write.items()),
                                  mode=prep.write_mode)
        write_json(storage, storage.join(directory, rank_manifest_name(prep.rank)),
                   _rank_record(prep, written, planned.save_id))
        every = _every_rank_written(storage, directory, prep, planned.save_id, written)
        if every is not None:
            commit(storage, directory, prep, every)


def _rank_record(prep: Prepared, written: dict, save_id: str) -> dict:
    """``rank_<r>.json`` of a save without a group: its file's record (as a version-1 reader reads one)."""
    return {"format": RANK_FORMAT, "format_version": CHUNKED_VERSION, "rank": prep.rank,
            "num_ranks": prep.world_size, "files": {data_file_name(prep.rank): written["record"]},
            "header": written["header"], "save_id": save_id}


def _every_rank_written(storage: Storage, directory: str, prep: Prepared, save_id: str,
                        own: dict) -> list[dict] | None:
    """Every rank's ``write_data_file`` result of this save, from the ``rank_<r>.json`` records; None
    while a rank has not finished it (no record, or one of another save). Highest rank first: ranks
    saving one after another stop at the first look."""
    written: list[dict | None] = [None] * prep.world_size
    written[prep.rank] = own
    for r in reversed(range(prep.world_size)):
        if r != prep.rank:
            written[r] = _read_rank_record(storage, directory, r, prep.world_size, save_id)
            if written[r] is None:
                return None
    return written


def _read_rank_record(storage: Storage, directory: str, rank: int, world_size: int, save_id: str) -> dict | None:
    path = storage.join(directory, rank_manifest_name(rank))
    if not storage.exists(path):
        return None
    try:
        obj = parse_json_object(path, storage.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES), fix="it is not this save's")
    except (MetadataError, FileNotFoundError):
        return None
    same = (obj.get("format"), obj.get("rank"), obj.get("num_ranks"), obj.get("save_id")) == (
        RANK_FORMAT, rank, world_size, save_id)
    record = (obj.get("files") or {}).get(data_file_name(rank)) if isinstance(obj.get("files"), dict) else None
    if not same or record is None or "header" not in obj:
        log.debug("%s is not a record of this save (yet); rank %d has not finished it", path, rank)
        return None
    return {"record": record, "header": obj["header"]}


def _save_with_group(storage: Storage, directory: str, coordinator, prepare) -> None:
    with contextlib.ExitStack() as held:
        planned, exc = attempt(prepare)
        if planned is not None:
            # Locked before the first exchange: a busy directory fails every rank untouched.
            _, exc = attempt(lambda: held.enter_context(_lock(storage, directory, planned.prep)))
        same_layout = agree(coordinator, {"error": describe(exc), "digest": planned.digest if planned else None},
                            exc, FIRST_STEP, on_root=lambda statuses: len({s["digest"] for s in statuses}) == 1,
                            slot_bytes=_STATUS_SLOT_BYTES)
        if not same_layout:
            raise TensorMismatchError(
                "ranks disagree on the tensors to save (names, shapes, dtypes or shard specs differ "
                "between ranks); every rank must pass the same structure and shard_spec")
        write_and_commit(planned.prep, storage, directory, coordinator, locked=True)

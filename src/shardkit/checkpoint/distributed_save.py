"""``save_distributed``: every rank writes its shard; the manifest is committed last.

Order of a save (FORMAT.md invariants 1-3):

1. check the inputs and plan (which tensors this rank writes);
2. take this rank's writer lock on the directory (``Storage.writer_lock``,
   slot = rank): a second save into a directory being written fails at once
   with :class:`~shardkit.errors.CheckpointBusyError` naming the writer; a
   killed writer leaves no stuck lock. With a group every rank locks before
   the first exchange, so a busy directory fails the whole group before
   anything is touched;
3. without a group, refuse to overwrite (below);
4. withdraw the old commit first: rank 0 removes ``metadata.json`` and each
   rank removes its ``rank_<r>.json``, so an interrupted overwrite of a
   directory reads as *incomplete*, never as an old manifest describing new,
   half-written files;
5. write ``rank_<r>.safetensors`` (atomically, with block checksums), then
   ``rank_<r>.json`` with its record;
6. rank 0 writes ``metadata.json``; the lock is released.

With a group, ranks agree at each of three steps (``agreement.agree``: the
ranks' small JSON statuses are gathered to rank 0, which broadcasts its
verdict; no pickle, O(ranks) messages a step): prepare and lock, withdraw,
write and commit. Nobody writes data before rank 0 has withdrawn the old
metadata, and rank 0 commits only after every rank reported its file
(their records go into ``metadata.json``); a failure on any rank fails the
save on every rank. Without a group each rank proceeds alone, as in the
seed; the per-rank manifests then tell whether every rank finished.

Overwriting. Saving each step into a fresh directory is the recommended
use: the previous checkpoint is then never touched. Overwriting a directory
in place is crash-safe with a group (the ranks agree), and with
``world_size == 1`` (one writer: the old commit is withdrawn before a byte
is written, so a cut-short save reads as incomplete, never as a mix); both
are always allowed. Without a group and with several ranks, the ranks
cannot agree on anything at save time: ``metadata.json`` and every
``rank_<r>.json`` carry a ``save_id`` (a digest of the layout, the plain
values and ``metadata``) and a rank manifest counts only if its id matches,
which keeps old and new rank files apart as long as the state carries
something that changes between saves (the step). When it does not (a
resumed job saving the same step again) and the save is cut short, the
directory would validate and load the new files of the ranks that finished
with the old files of the others. Such a save is therefore refused with
:class:`~shardkit.errors.CheckpointExistsError` before it touches anything:
rank ``r`` refuses when its own ``rank_<r>.json`` or ``rank_<r>.safetensors``
is there (rank 0 also ``metadata.json``), files only an earlier save can
have written, never ones a faster rank of the same save may just have
written. ``overwrite=True`` allows it, with exactly the risk above. Without
a group every rank must pass the same plain values and ``metadata`` (they
are stored once anyway). This module does not stage tensors for background
saving (see ``async_save``).

Example::

    spec = ShardMetadata(2, {"w": TensorShardSpec((8, 4), 0, (4, 4))})
    save_distributed({"w": w_slice, "step": 10}, "/ckpt/step-10", rank, 2, spec, group=pg)
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import xxhash

from shardkit.checkpoint.agreement import FIRST_STEP, agree, attempt, describe
from shardkit.checkpoint.group import resolve_group
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.manifest import (
    METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, rank_manifest_json,
    rank_manifest_name, write_json,
)
from shardkit.checkpoint.nested import Flat, flatten
from shardkit.checkpoint.plan import SavePlan, plan_save
from shardkit.checkpoint.spec import TensorShardSpec, as_spec_dict, check_local_tensor, check_world
from shardkit.dtypes import to_safetensors_name
from shardkit.errors import CheckpointExistsError, TensorMismatchError
from shardkit.storage import FileRecord, Storage, storage_for, write_safetensors

__all__ = ["save_distributed"]

#: Gather slots (group.settle) that fit the usual status: an error-only one, and one with a layout digest.
_ERROR_SLOT_BYTES = 32
_STATUS_SLOT_BYTES = 96


@dataclass
class _Prepared:
    flat: Flat
    plan: SavePlan
    manifest: Manifest
    digest: str


@logged("save_distributed")
def save_distributed(state_dict, dir, rank, world_size, shard_spec, *, group=None, metadata=None,
                     overwrite: bool = False) -> None:
    """Save this rank's part of ``state_dict`` into the checkpoint directory ``dir``.

    ``state_dict`` may be nested; tensors named (by dotted path) in
    ``shard_spec`` are this rank's slices, every other tensor is replicated
    and written once, by its owner rank. Plain leaves and ``metadata``
    (JSON-serialisable, stored as ``user_metadata``) go into ``metadata.json``.
    It does not return before this rank's files are durable; with a
    ``group``, not before the whole checkpoint is committed.

    Raises :class:`MetadataError` for a bad rank or spec, :class:`TensorMismatchError`
    for a tensor that does not fit its spec, ``TypeError`` for a leaf that
    cannot be saved without pickle.

    >>> save_distributed({"w": torch.ones(4)}, "/tmp/ck", 0, 1, None)
    """
    check_world(rank, world_size)
    coordinator = resolve_group(group, rank, world_size)
    storage, directory = storage_for(dir)
    if coordinator is None:
        prep = _prepare(state_dict, rank, world_size, shard_spec, metadata)
        _save_alone(storage, directory, prep, refuse_existing=world_size > 1 and not overwrite)
    else:
        _save_with_group(storage, directory, coordinator,
                         lambda: _prepare(state_dict, rank, world_size, shard_spec, metadata))


def _prepare(state_dict, rank, world_size, shard_spec, user_metadata) -> _Prepared:
    flat = flatten(state_dict)
    specs = as_spec_dict(shard_spec, world_size)
    for name in specs:
        if name not in flat.tensors:
            what = "a plain value" if name in flat.objects else "not in the state"
            raise TensorMismatchError(f"shard_spec names {name!r}, which is {what}; on rank {rank} the "
                                      f"state's tensors are: {', '.join(sorted(flat.tensors)[:8]) or 'none'}")
    saved = {}
    for name, tensor in flat.tensors.items():
        if name == "__metadata__":
            raise TensorMismatchError("a tensor cannot be named '__metadata__' (safetensors reserves it)")
        spec = specs.get(name) or TensorShardSpec(tuple(tensor.shape), None, ())
        check_local_tensor(name, tuple(tensor.shape), spec, rank, world_size)
        saved[name] = SavedTensor(spec, to_safetensors_name(tensor.dtype))
    plan = plan_save({n: t.numel() * t.element_size() for n, t in flat.tensors.items()}, specs, rank, world_size)
    saved = {n: SavedTensor(s.spec, s.dtype, plan.owner_of.get(n)) for n, s in saved.items()}
    manifest = Manifest(1, world_size, saved, {}, flat.objects, flat.structure, _user_metadata(user_metadata))
    manifest.save_id = _save_id(manifest)
    return _Prepared(flat, plan, manifest, _digest(manifest))


def _user_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a JSON-serialisable dict, got {type(metadata).__name__}")
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (nothing is pickled): {e}") from e
    return json.loads(text)  # a snapshot: a background save writes what the caller passed, not later edits


def _digest(m: Manifest) -> str:
    # What every rank must agree on: names, layouts, dtypes, owners (not plain values).
    layout = manifest_to_json(Manifest(1, m.num_ranks, m.tensors))["tensor_specs"]
    return xxhash.xxh3_64_hexdigest(json.dumps(layout, sort_keys=True).encode())


#: Set by launchers, equal on every rank of one attempt of a job, different for its restart or requeue.
_ATTEMPT_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")


def _save_id(m: Manifest) -> str:
    # Without a group, ranks cannot agree on a fresh id; the layout plus the plain
    # values and user metadata (equal on every rank) tell one save from another
    # whenever the state carries something that changes, such as the step. The
    # launcher's attempt tells a restarted job's save of a step from the files its
    # killed attempt left of the same step: those never complete the new one.
    attempt = {name: os.environ.get(name) for name in _ATTEMPT_ENV}
    text = json.dumps([_digest(m), m.objects, m.structure, m.user_metadata, attempt], sort_keys=True, default=str)
    return xxhash.xxh3_64_hexdigest(text.encode())


def _withdraw(storage: Storage, directory: str, rank: int) -> None:
    # Called with the writer lock held, which made the directory. One request on an object store.
    names = ([METADATA_FILE] if rank == 0 else []) + [rank_manifest_name(rank)]
    storage.remove_files([storage.join(directory, n) for n in names])


def _write_rank_files(storage: Storage, directory: str, prep: _Prepared) -> dict[str, FileRecord]:
    rank, world_size = prep.plan.rank, prep.plan.world_size
    named = [(n, prep.flat.tensors[n]) for n in prep.plan.write_names]
    file_name = data_file_name(rank)
    record = write_safetensors(storage, storage.join(directory, file_name), named,
                               {"format": "pt", "shardkit.rank": str(rank), "shardkit.num_ranks": str(world_size)})
    records = {file_name: record}
    write_json(storage, storage.join(directory, rank_manifest_name(rank)),
               rank_manifest_json(rank, world_size, records, prep.manifest.save_id))
    return records


def _commit(storage: Storage, directory: str, prep: _Prepared, records: dict[str, FileRecord]) -> None:
    prep.manifest.files = dict(records)
    write_json(storage, storage.join(directory, METADATA_FILE), manifest_to_json(prep.manifest))


def _lock(storage: Storage, directory: str, plan: SavePlan) -> contextlib.AbstractContextManager:
    # One slot per rank: the ranks of one save never block each other, and rank 0's
    # slot is the one an HF save of the same directory takes.
    return storage.writer_lock(directory, slot=plan.rank,
                               holder=f"save_distributed rank {plan.rank} of {plan.world_size}")


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


def _save_alone(storage: Storage, directory: str, prep: _Prepared, *, refuse_existing: bool) -> None:
    with _lock(storage, directory, prep.plan):
        if refuse_existing:
            _refuse_existing(storage, directory, prep.plan.rank, prep.plan.world_size)
        _withdraw(storage, directory, prep.plan.rank)
        records = _write_rank_files(storage, directory, prep)
        if prep.plan.rank == 0:
            _commit(storage, directory, prep, records)


def _save_with_group(storage: Storage, directory: str, coordinator, prepare) -> None:
    with contextlib.ExitStack() as held:
        prep, exc = attempt(prepare)
        if prep is not None:
            # Locked before the first exchange: a busy directory fails every rank untouched.
            _, exc = attempt(lambda: held.enter_context(_lock(storage, directory, prep.plan)))
        _save_locked(storage, directory, coordinator, prep, exc)


def _save_locked(storage: Storage, directory: str, coordinator, prep: _Prepared | None, exc) -> None:
    # Three steps, each one gather to rank 0 and one broadcast of its verdict (agreement.py).
    same_layout = agree(coordinator, {"error": describe(exc), "digest": prep.digest if prep else None}, exc,
                        FIRST_STEP, on_root=lambda statuses: len({s["digest"] for s in statuses}) == 1,
                        slot_bytes=_STATUS_SLOT_BYTES)
    if not same_layout:
        raise TensorMismatchError(
            "ranks disagree on the tensors to save (names, shapes, dtypes or shard specs differ "
            "between ranks); every rank must pass the same structure and shard_spec")
    rank = prep.plan.rank
    _, exc = attempt(lambda: _withdraw(storage, directory, rank))
    agree(coordinator, {"error": describe(exc)}, exc, "withdrawing the previous metadata",
          slot_bytes=_ERROR_SLOT_BYTES)
    records, exc = attempt(lambda: _write_rank_files(storage, directory, prep))

    def commit(statuses: list[dict]) -> None:            # rank 0, once every rank wrote its file
        _commit(storage, directory, prep, {f: FileRecord.from_json(f, r) for s in statuses
                                           for f, r in s["files"].items()})

    agree(coordinator, {"error": describe(exc), "files": {f: r.to_json() for f, r in (records or {}).items()}},
          exc, "writing the data files", on_root=commit, root_step="writing metadata.json")

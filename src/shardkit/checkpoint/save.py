"""``save_distributed``: every rank writes its shard; the manifest is committed last.

Order of a save (FORMAT.md invariants 1-3):

1. check the inputs and plan (which tensors this rank writes);
2. withdraw the old commit first: rank 0 removes ``metadata.json`` and each
   rank removes its ``rank_<r>.json``, so an interrupted overwrite of a
   directory reads as *incomplete*, never as an old manifest describing new,
   half-written files;
3. write ``rank_<r>.safetensors`` (atomically, with block checksums), then
   ``rank_<r>.json`` with its record;
4. rank 0 writes ``metadata.json``.

With a group, ranks agree at each step (a pickle-free all-gather of small
JSON statuses): nobody writes data before rank 0 has withdrawn the old
metadata, and rank 0 commits only after every rank reported its file
(their records go into ``metadata.json``); a failure on any rank fails the
save on every rank. Without a group each rank proceeds alone, as in the
seed; the per-rank manifests then tell whether every rank finished.

Saving each step into a fresh directory is the recommended use: the
previous checkpoint is then never touched. Overwriting a directory in place
is crash-safe with a group. Without one, the ranks cannot agree on anything
at save time, so ``metadata.json`` and every ``rank_<r>.json`` carry a
``save_id`` (a digest of the layout, the plain values and ``metadata``) and
a rank manifest counts only if its id matches: old and new rank files never
complete each other as long as the state carries something that changes
between saves (the step, say). Without a group every rank must therefore
pass the same plain values and ``metadata`` (they are stored once anyway).
This module does not stage tensors for background saving (see
``async_save``).

Example::

    spec = ShardMetadata(2, {"w": TensorShardSpec((8, 4), 0, (4, 4))})
    save_distributed({"w": w_slice, "step": 10}, "/ckpt/step-10", rank, 2, spec, group=pg)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from shardkit.checkpoint.group import exchange, resolve_group
from shardkit.checkpoint.manifest import (
    METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, rank_manifest_json,
    rank_manifest_name, write_json,
)
from shardkit.checkpoint.nested import Flat, flatten
from shardkit.checkpoint.plan import SavePlan, plan_save
from shardkit.checkpoint.spec import TensorShardSpec, as_spec_dict, check_local_tensor, check_world
from shardkit.dtypes import to_safetensors_name
from shardkit.errors import CheckpointError, TensorMismatchError
from shardkit.storage import FileRecord, Storage, storage_for, write_safetensors

__all__ = ["save_distributed"]


@dataclass
class _Prepared:
    flat: Flat
    plan: SavePlan
    manifest: Manifest
    digest: str


def save_distributed(state_dict, dir, rank, world_size, shard_spec, *, group=None, metadata=None) -> None:
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
        _save_alone(storage, directory, _prepare(state_dict, rank, world_size, shard_spec, metadata))
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
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (nothing is pickled): {e}") from e
    return metadata


def _digest(m: Manifest) -> str:
    # What every rank must agree on: names, layouts, dtypes, owners (not plain values).
    layout = manifest_to_json(Manifest(1, m.num_ranks, m.tensors))["tensor_specs"]
    return xxhash.xxh3_64_hexdigest(json.dumps(layout, sort_keys=True).encode())


def _save_id(m: Manifest) -> str:
    # Without a group, ranks cannot agree on a fresh id; the layout plus the plain
    # values and user metadata (equal on every rank) tell one save from another
    # whenever the state carries something that changes, such as the step.
    text = json.dumps([_digest(m), m.objects, m.structure, m.user_metadata], sort_keys=True, default=str)
    return xxhash.xxh3_64_hexdigest(text.encode())


def _remove_if_present(storage: Storage, path: str) -> None:
    if storage.exists(path):
        try:
            storage.remove(path)
        except FileNotFoundError:
            pass  # another process got there first: the goal is reached


def _withdraw(storage: Storage, directory: str, rank: int) -> None:
    storage.makedirs(directory)
    if rank == 0:
        _remove_if_present(storage, storage.join(directory, METADATA_FILE))
    _remove_if_present(storage, storage.join(directory, rank_manifest_name(rank)))


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


def _save_alone(storage: Storage, directory: str, prep: _Prepared) -> None:
    _withdraw(storage, directory, prep.plan.rank)
    records = _write_rank_files(storage, directory, prep)
    if prep.plan.rank == 0:
        _commit(storage, directory, prep, records)


def _save_with_group(storage: Storage, directory: str, coordinator, prepare) -> None:
    prep, exc = _attempt(prepare)
    statuses = exchange(coordinator, {"error": _describe(exc), "digest": prep.digest if prep else None}, "preparing the save")
    _raise_first(statuses, exc, "preparing the save")
    if len({s["digest"] for s in statuses}) > 1:
        raise TensorMismatchError(
            "ranks disagree on the tensors to save (names, shapes, dtypes or shard specs differ "
            "between ranks); every rank must pass the same structure and shard_spec")
    rank = prep.plan.rank
    _, exc = _attempt(lambda: _withdraw(storage, directory, rank))
    _raise_first(exchange(coordinator, {"error": _describe(exc)}, "withdrawing the previous metadata"), exc,
                 "withdrawing the previous metadata")
    records, exc = _attempt(lambda: _write_rank_files(storage, directory, prep))
    statuses = exchange(coordinator, {"error": _describe(exc),
                                      "files": {f: r.to_json() for f, r in (records or {}).items()}}, "writing the data files")
    _raise_first(statuses, exc, "writing the data files")
    exc = None
    if rank == 0:
        every = {f: FileRecord.from_json(f, r) for s in statuses for f, r in s["files"].items()}
        _, exc = _attempt(lambda: _commit(storage, directory, prep, every))
    _raise_first(exchange(coordinator, {"error": _describe(exc)}, "writing metadata.json"), exc,
                 "writing metadata.json")


def _attempt(fn):
    """``(result, None)`` or ``(None, exception)``: a rank's failure must reach the others, not hang them."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        return None, e


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _raise_first(statuses: list[dict], own: BaseException | None, step: str) -> None:
    if own is not None:
        raise own
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s.get("error")]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"the save failed on rank {rank} while {step}: {message}; "
                              f"this checkpoint is incomplete (metadata.json was not written)")

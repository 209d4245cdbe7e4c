"""The chunked save (format version 3): prepare on the caller's thread, then write and commit.

Steps (``docs/format.md``, invariants 1-3):

1. :func:`prepare`: flatten the state, find each tensor's box
   (``dtensor_layout``) and describe the layout compactly
   (``compact_layout``: per tensor its shape, dtype and plain / row / mesh
   layout, equal on every rank). Each rank sends rank 0 O(1) facts: the
   description's digest, its global rank (hence its mesh coordinates),
   whether its own boxes are the predicted ones, any error, and its
   ``rank_state`` plain leaves. Rank 0 tells every rank whether all agree;
   then each rank computes what it writes itself (``writer_choice``);
   otherwise an all-gather exchange hands every rank every rank's boxes and
   ``chunk_plan`` plans from them (its errors name the rank that differs).
   Every rank fails together on a bad state.
2. :func:`write_and_commit`: rank 0 withdraws an old ``metadata.json``; every
   rank writes ``rank_<r>.safetensors`` with the boxes it was given (possibly
   none) and reports its file record and its header's digest; rank 0
   computes the whole plan and every file's byte ranges (``file_layout``),
   checks each reported file against them and writes ``metadata.json``
   (version 3: each tensor a compact grid where its chunks form one, else
   its chunk list; ``compact_manifest``) last. On the agreed path rank 0
   plans grids straight from the description (``grid_plan``): its commit
   work is O(tensors + ranks), not one object per chunk.

Collectives: three rounds (prepare; lock and withdraw; write and commit),
each one gather of the ranks' statuses to rank 0 and one broadcast of its
verdict (``agreement.agree``): 6 collectives of O(ranks) messages each. A
status longer than its round's slot (``ROUND_SLOTS``; e.g. a file record
with many block checksums) adds a broadcast and a gather to its round; the
fallback adds an all-gather exchange (2 all-gathers).

Rank 0 receives O(ranks + tensors) bytes per save on the agreed path (plus
the ranks' ``rank_state`` plain leaves and block checksums, which grow with
the user's data only); ``metadata.json`` lists a regular layout as one
grid entry and only irregular ones chunk by chunk. Step 2
issues collectives only on the coordinator it is given, so a background save
runs it on a group of its own. With no coordinator (one process) there is
nothing to agree on. This module does not stage tensors.

Example::

    prep = prepare(state, coordinator, rank, world_size, metadata=None)
    write_and_commit(prep, storage, directory, coordinator)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardkit import knobs
from shardkit.checkpoint.planning.chunk_plan import ChunkPlan, plan_chunks
from shardkit.checkpoint.format.chunks import Chunk
from shardkit.checkpoint.format.compact_manifest import GridChunks, grid_of_chunks
from shardkit.checkpoint.planning.compact_layout import Description, describe, own_boxes_agree, prediction_trusted
from shardkit.checkpoint.planning.dtensor_layout import local_box
from shardkit.checkpoint.coordination.agreement import agree, attempt, describe as describe_error
from shardkit.checkpoint.coordination.group import SLOT_BYTES, exchange
from shardkit.checkpoint.saving.incremental import read_base, used_bases, write_changed
from shardkit.checkpoint.saving.prepared import Prepared
from shardkit.checkpoint.format.manifest import (
    COMPACT_VERSION, METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, rank_manifest_name,
    write_json,
)
from shardkit.checkpoint.format.nested import flatten
from shardkit.checkpoint.format.rank_state import check_reserved, rank_state_objects, rank_state_report
from shardkit.checkpoint.format.spec import TensorShardSpec
from shardkit.checkpoint.planning.grid_plan import GridPlan, grid_plan
from shardkit.checkpoint.planning.writer_choice import full_plan, own_writes
from shardkit.dtypes import NAME_TO_DTYPE, itemsize_bytes, to_safetensors_name
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import Box
from shardkit.storage import FileLayout, FileRecord, Storage, file_layout, write_safetensors
from shardkit.storage.checksum import block_digest
from shardkit.storage.fast_io.write_mode import FOREGROUND, PACED_SHARE_OF_DEADLINE, WriteMode
from shardkit.storage.json_io import gc_paused

__all__ = ["Prepared", "prepare", "write_and_commit", "snapshot_metadata", "withdraw", "write_data_file", "commit"]


_WITHDRAW_STEP = "locking the directory and withdrawing the previous metadata"
#: Gather slots (group.settle) that fit the usual status: an error-only one, and the layout facts
#: (a longer status, e.g. with rank_state plain leaves, still goes through, in one more gather).
_ERROR_SLOT_BYTES = 32
_LAYOUT_SLOT_BYTES = 160
#: The save's rounds (step, gather slot) in order: what ``bench/checkpoint_suites/scale_bench.py`` times alone.
ROUND_SLOTS = (("preparing the save", _LAYOUT_SLOT_BYTES), (_WITHDRAW_STEP, _ERROR_SLOT_BYTES),
               ("writing the data files", SLOT_BYTES))


def snapshot_metadata(metadata) -> dict:
    """A JSON copy of a save's ``metadata=`` (None: ``{}``): a background save writes what the caller passed,
    not later edits. Raises ``TypeError`` for anything JSON cannot hold (nothing is pickled).

    >>> snapshot_metadata({"note": "hi"})
    {'note': 'hi'}
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a JSON-serialisable dict, got {type(metadata).__name__}")
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable (nothing is pickled): {e}") from e
    return json.loads(text)


def withdraw(storage: Storage, directory: str, rank: int, *, commit: bool | None = None) -> None:
    """Remove the old commit before a byte is written: ``metadata.json`` (``commit``; default: on rank 0)
    and this rank's ``rank_<r>.json``, so an interrupted overwrite reads as incomplete, never as an old
    manifest over new files. Call it with the writer lock held (which made the directory); one request
    on an object store."""
    names = ([METADATA_FILE] if (rank == 0 if commit is None else commit) else []) + [rank_manifest_name(rank)]
    storage.remove_files([storage.join(directory, n) for n in names])


def _all(coordinator, value, step: str) -> list:
    return [value] if coordinator is None else exchange(coordinator, value, step)


@dataclass
class _Mine:
    """This rank's part of the plan, before any exchange."""

    boxes: dict[str, Box]
    local: dict[str, torch.Tensor]
    flat: Any
    rank_objects: dict
    user_metadata: dict
    desc: Description
    global_rank: int | None
    boxes_agree: bool

    def report(self) -> dict:
        """Every box this rank holds (the fallback exchange: O(tensors) per rank)."""
        return {n: [list(t.full_shape), t.dtype, list(self.boxes[n].offsets), list(self.boxes[n].sizes)]
                for n, t in self.desc.tensors.items()}


def _global_rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _mine(state_dict, rank_state, rank: int, world_size: int, metadata) -> _Mine:
    flat = flatten(state_dict)
    boxes, local = {}, {}
    for name, t in flat.tensors.items():
        if name == "__metadata__":
            raise TensorMismatchError("a tensor cannot be named '__metadata__' (safetensors reserves it)")
        boxes[name], local[name] = local_box(name, t)
    check_reserved([*flat.tensors, *flat.objects])
    row_report, rows, rank_objects = rank_state_report(rank_state, rank, world_size)
    boxes.update({n: Box(tuple(r[2]), tuple(r[3])) for n, r in row_report.items()})
    desc = describe(flat.tensors, rows, world_size)
    global_rank = _global_rank()
    try:
        agree = own_boxes_agree(desc, boxes, global_rank, rank)
    except Exception:  # noqa: BLE001 - a prediction that fails is one not to plan from
        agree = False
    return _Mine(boxes, {**local, **rows}, flat, rank_objects, snapshot_metadata(metadata), desc, global_rank, agree)


def prepare(state_dict, coordinator, rank: int, world_size: int, metadata=None, rank_state=None) -> Prepared:
    """Plan a chunked save; a collective on ``coordinator`` (None: one process). Writes nothing.

    ``rank_state``: per-rank values (``rank_state.py``), stored beside the state."""
    mine, exc = attempt(lambda: _mine(state_dict, rank_state, rank, world_size, metadata))
    at_root: dict = {}

    def decide(statuses: list[dict]) -> bool:          # rank 0: may every rank plan from the compact layout?
        global_ranks = [s["global_rank"] for s in statuses]
        at_root.update(global_ranks=global_ranks, objects=rank_state_objects(statuses))
        return (len({s["digest"] for s in statuses}) == 1 and all(s["agree"] for s in statuses)
                and prediction_trusted(mine.desc, global_ranks))

    compact = agree(coordinator, {"error": describe_error(exc), "digest": mine.desc.digest() if mine else None,
                                  "global_rank": mine.global_rank if mine else None,
                                  "agree": mine.boxes_agree if mine else False,
                                  "rank_objects": mine.rank_objects if mine else None},
                    exc, "preparing the save", on_root=decide, slot_bytes=_LAYOUT_SLOT_BYTES)
    if compact:
        writes = own_writes(mine.desc, rank, world_size, mine.global_rank, mine.boxes)
        plan_all = None                  # rank 0 plans at commit, once it knows whether the save has a base
    else:
        reports = _all(coordinator, mine.report(), "exchanging every rank's boxes (the compact layouts differ)")
        plan = plan_chunks(reports, lambda d: itemsize_bytes(NAME_TO_DTYPE[d]))
        writes, plan_all = plan.writes[rank], lambda: plan
    # Every rank's plain per-rank leaves reach rank 0 only, which alone writes metadata.json.
    objects = {**mine.flat.objects, **at_root.get("objects", mine.rank_objects)}
    boxes = {n: (tuple(mine.desc.tensors[n].full_shape), mine.boxes[n]) for n in writes if n in mine.desc.tensors}
    prep = Prepared(rank, world_size, plan_all, {n: mine.local[n] for n in writes}, objects,
                    mine.flat.structure, mine.user_metadata, boxes=boxes)
    if plan_all is None:   # no grid in an incremental save: its chunks may lie in the base
        prep.full_plan = lambda: _agreed_plan(mine.desc, at_root["global_ranks"], world_size,  # noqa: E731
                                              grids=prep.base_dir is None)
    return prep


def _agreed_plan(desc, global_ranks: list, world_size: int, grids: bool = True) -> ChunkPlan | GridPlan:
    """Rank 0's plan of an agreed save: grids (O(tensors + ranks)) where ``grids`` allows them (not in an
    incremental save, whose chunks may live in a base), ``knobs.COMPACT_MIN_RANKS`` asks for compact
    entries and every layout is a grid by construction, else every box (O(chunks))."""
    wanted = grids and world_size >= knobs.COMPACT_MIN_RANKS
    compact = grid_plan(desc, global_ranks, world_size) if wanted else None
    return compact or full_plan(desc, global_ranks, world_size)


def _file_metadata(rank: int, world_size: int) -> dict[str, str]:
    return {"format": "pt", "shardkit.rank": str(rank), "shardkit.num_ranks": str(world_size)}


def _header_digest(layout: FileLayout) -> str:
    return block_digest(layout.header)    # what FileRecord.header_checksum holds for the file written


def write_data_file(storage: Storage, directory: str, rank: int, world_size: int, named: list, *,
                    mode: WriteMode = FOREGROUND) -> dict:
    """Write ``rank_<rank>.safetensors`` holding ``named`` (``(name, tensor or LazyTensor)``, each the
    tensor's chunk this rank writes); returns what the commit checks it by: ``{"record", "header",
    "data_start"}`` (the file's record, its header's digest and length: where its data starts), written as ``mode`` says."""
    metadata = _file_metadata(rank, world_size)
    record = write_safetensors(storage, storage.join(directory, data_file_name(rank)), named, metadata, mode=mode)
    layout = file_layout([(n, to_safetensors_name(t.dtype), tuple(t.shape)) for n, t in named], metadata)
    return {"record": record.to_json(), "header": record.header_checksum, "data_start": len(layout.header)}


def _write_file(storage: Storage, directory: str, prep: Prepared) -> dict:
    """Write this rank's file; with a base, only the chunks whose bytes differ from the base's (the
    others are reported as ``refs``: ``name -> [file key, begin, end]``, for the commit). The file
    may be published twice (``incremental.write_changed``); the commit checks the last one. The
    result is kept as ``prep.written`` too (what the next save's staging proof starts from)."""
    if prep.base_dir is None:
        prep.written = write_data_file(storage, directory, prep.rank, prep.world_size, list(prep.to_write.items()),
                                       mode=prep.write_mode)
        return prep.written
    prep.base_view = view = read_base(storage, directory, prep.base_dir)
    written, refs = write_changed(storage, directory, view, prep.boxes, prep.to_write,
                                  lambda named: write_data_file(storage, directory, prep.rank, prep.world_size, named,
                                                                mode=prep.write_mode), proven=prep.proven)
    prep.written = {**written, "refs": refs, "base": view.save_id}
    return prep.written


def _check_written(rank: int, layout: FileLayout, written: dict) -> FileRecord:
    name = data_file_name(rank)
    record = FileRecord.from_json(name, written["record"])
    if record.bytes != layout.size_bytes or written["header"] != _header_digest(layout):
        raise MetadataError(
            f"rank {rank} wrote {name} of {record.bytes} bytes with header digest {written['header']}, but the "
            f"save's plan gives that file {layout.size_bytes} bytes and digest {_header_digest(layout)} "
            f"({len(layout.entries)} tensors); the ranks planned different writes. Nothing was committed: "
            f"report a bug with the state's layout")
    return record


def commit(storage: Storage, directory: str, prep: Prepared, written: list[dict]) -> None:
    """Write ``metadata.json`` (version 3) for ``prep``'s whole plan, once every rank's file is written:
    ``written[r]`` is rank r's :func:`write_data_file` result, checked against the plan (``MetadataError``
    naming the rank whose file differs; nothing committed)."""
    with gc_paused():  # O(ranks x tensors) objects at once: no full collection in the middle
        manifest = manifest_to_json(_manifest(prep, written))
    write_json(storage, storage.join(directory, METADATA_FILE), manifest)  # the write waits: outside the pause


def _manifest(prep: Prepared, written: list[dict]) -> Manifest:
    plan = prep.full_plan()
    if isinstance(plan, GridPlan):
        return _grid_manifest(prep, plan, written)
    refs = _references(prep, written)
    held: list[list] = [[] for _ in range(prep.world_size)]
    for name, t in plan.tensors.items():
        for box, r in t.box_to_writer.items():
            if name not in refs[r]:
                held[r].append((name, t.dtype, box.sizes))
    files, ranges = {}, []
    for r in range(prep.world_size):
        layout = file_layout(held[r], _file_metadata(r, prep.world_size))
        files[data_file_name(r)] = _check_written(r, layout, written[r])
        ranges.append({e.name: (data_file_name(r), e.begin, e.end) for e in layout.entries})
        ranges[r].update({n: tuple(ref) for n, ref in refs[r].items()})
    tensors = {}
    for name, t in plan.tensors.items():
        chunks = tuple(Chunk(*ranges[r][name][:1], box.offsets, box.sizes, *ranges[r][name][1:])
                       for box, r in sorted(t.box_to_writer.items(), key=lambda br: br[0].offsets))
        # Chosen automatically: a grid wherever the chunks form one (in saves of COMPACT_MIN_RANKS ranks or
        # more; a chunk referenced in a base never is one).
        grid = grid_of_chunks(t.full_shape, chunks) if prep.world_size >= knobs.COMPACT_MIN_RANKS else None
        tensors[name] = SavedTensor(TensorShardSpec(t.full_shape, None, ()), t.dtype, None,
                                    chunks if grid is None else GridChunks(grid), prep.split_dims.get(name),
                                    prep.empty_split_sizes.get(name))
    keys = {ref[0] for r in refs for ref in r.values()}
    bases = used_bases(prep.base_view, keys) if keys else []
    files.update({k: prep.base_view.records[k] for k in sorted(keys)})
    return Manifest(COMPACT_VERSION, prep.world_size, tensors, files, prep.objects, prep.structure,
                    prep.user_metadata, bases=bases)


def _references(prep: Prepared, written: list[dict]) -> list[dict[str, list]]:
    """Each rank's referenced chunks (``name -> [key, begin, end]``), checked: every rank compared
    against the base rank 0 read (``MetadataError`` otherwise; nothing committed)."""
    refs = [w.get("refs") or {} for w in written]
    if any(refs):
        ids = {w.get("base") for w in written}
        if prep.base_view is None or ids != {prep.base_view.save_id}:
            raise MetadataError(f"the ranks of an incremental save compared their chunks against different "
                                f"versions of the base {prep.base_dir} ({sorted(map(str, ids))}): it changed "
                                f"during the save. Nothing was committed; save again")
    return refs


def _grid_manifest(prep: Prepared, plan: GridPlan, written: list[dict]) -> Manifest:
    """The manifest of an agreed save, every tensor a grid: O(tensors + ranks) (``grid_plan``)."""
    files = {data_file_name(r): _check_sized(r, int(plan.data_bytes[r]), written[r]) for r in range(prep.world_size)}
    tensors = {name: SavedTensor(TensorShardSpec(shape, None, ()), dtype, None,
                                 () if grid is None else GridChunks(grid), prep.split_dims.get(name),
                                 prep.empty_split_sizes.get(name))
               for name, (shape, dtype, grid) in plan.tensors.items()}
    return Manifest(COMPACT_VERSION, prep.world_size, tensors, files, prep.objects, prep.structure,
                    prep.user_metadata)


def _check_sized(rank: int, data_bytes: int, written: dict) -> FileRecord:
    """Rank ``rank``'s file record, checked to hold exactly the planned ``data_bytes`` after its header
    (the header itself, each entry's name, shape and dtype, is checked by every load against the
    metadata, and its byte ranges by ``validate``)."""
    name = data_file_name(rank)
    record = FileRecord.from_json(name, written["record"])
    start = written.get("data_start")
    if not isinstance(start, int) or start < 8 or record.bytes != start + data_bytes:
        raise MetadataError(
            f"rank {rank} wrote {name} of {record.bytes} bytes with its data starting at byte {start}, but the "
            f"save's plan puts {data_bytes} bytes of tensor data in that file; the ranks planned different writes. "
            f"Nothing was committed: report a bug with the state's layout")
    return record


def _paced_limit_s(coordinator) -> float | None:
    """How long a paced write may stay paced before the exchange every rank meets at after it."""
    return None if coordinator is None else coordinator.timeout.total_seconds() * PACED_SHARE_OF_DEADLINE


def write_and_commit(prep: Prepared, storage: Storage, directory: str, coordinator,
                     before_write: Callable[[], None] | None = None, *, failed: BaseException | None = None,
                     locked: bool = False) -> None:
    """Write this rank's file and, on rank 0, ``metadata.json`` last; collectives on ``coordinator``.

    ``before_write`` runs on rank 0 before anything is touched (the manager
    clears a crashed save's leftovers there); every rank waits for it. Each
    rank holds its writer lock from before the first exchange to the end, so
    a second save into a directory being written fails at once on every rank
    (``CheckpointBusyError``) and touches nothing. ``failed``: this rank
    could not get its part ready (staging ran out of memory); it touches
    nothing and reports that at the first exchange, so every rank's save
    fails there at once instead of waiting for it until the group's timeout. ``locked``: the caller
    already holds this rank's writer lock (``save_distributed`` takes it before its own first exchange).
    """
    with contextlib.ExitStack() as held:
        _write_and_commit_locked(prep, storage, directory, coordinator, before_write, None if locked else held,
                                 failed)


def _write_and_commit_locked(prep: Prepared, storage: Storage, directory: str, coordinator,
                             before_write: Callable[[], None] | None, held: contextlib.ExitStack | None,
                             failed: BaseException | None) -> None:
    def lock_and_withdraw():
        # Locked inside the first step: a busy directory fails every rank before anything is touched.
        if held is not None:
            held.enter_context(storage.writer_lock(
                directory, slot=prep.rank, holder=f"shardkit.checkpoint.save rank {prep.rank} of {prep.world_size}"))
        if before_write is not None and prep.rank == 0:
            before_write()
        withdraw(storage, directory, prep.rank)

    _, exc = attempt(lock_and_withdraw) if failed is None else (None, failed)
    agree(coordinator, {"error": describe_error(exc)}, exc, _WITHDRAW_STEP, slot_bytes=_ERROR_SLOT_BYTES)
    with prep.write_mode.paced_for_at_most(_paced_limit_s(coordinator)):   # others wait for it below
        written, exc = attempt(lambda: _write_file(storage, directory, prep))

    def on_root(statuses: list[dict]) -> None:            # rank 0, once every rank wrote its file
        commit(storage, directory, prep, [s["written"] for s in statuses])

    agree(coordinator, {"error": describe_error(exc), "written": written}, exc, "writing the data files",
          on_root=on_root, root_step="writing metadata.json")

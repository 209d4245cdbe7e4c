"""``save_checkpoint`` of a DTensor state (FSDP2, HSDP, TP) inside the job: a collective over the group.

Every rank writes the whole tensors assigned to it (balanced by bytes,
``export_plan``), each gathered from the ranks that hold its boxes
(``gather``), cast on the way out when ``dtype`` is given; rank 0 writes
the configs and, last, the index, once every rank's files are complete.
The steps are settled over the group as a distributed save's are
(``checkpoint.coordination.agreement``): a failure on any rank (a busy directory, a full
disk) raises on every rank, none is left waiting, and the previous
checkpoint is removed only once every rank is ready to write. Memory per
rank: about three of the largest tensors it writes (one written, one handed
over, one being assembled) plus its own parts of the round's other tensors,
cast for sending; never the model. Not here: the one-process save
(``save.py``), loading. Every rank of the group must call it, with the same
state names, shapes and dtypes; all ranks must see one shared directory.

Example (on every rank of an FSDP2 job)::

    save_checkpoint("export/step-100", model, safetensors=True, dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

from shardkit.checkpoint.coordination.agreement import agree, attempt, describe
from shardkit.checkpoint.api import resolve_world
from shardkit.checkpoint.planning.dtensor_layout import is_dtensor, local_box
from shardkit.checkpoint.coordination.group import exchange
from shardkit.dtypes import itemsize_bytes
from shardkit.errors import TensorMismatchError
from shardkit.hf.saving.export_plan import ExportPlan, out_dtype, plan_export
from shardkit.hf.saving.export_write import export_index, remove_previous, write_files, write_order, write_tail
from shardkit.hf.saving.gather import GatherTensor, Handoff, rounds_of, run_rounds
from shardkit.layout import Box, cover_problem, whole_box
from shardkit.storage import LazyTensor, storage_for

__all__ = ["holds_dtensors", "save_in_job"]

_HOLDER = "shardkit.hf.save_checkpoint"


def holds_dtensors(sd: Mapping[str, torch.Tensor]) -> bool:
    """Whether any tensor of ``sd`` is a DTensor: the save is then a collective."""
    return any(is_dtensor(t) for t in sd.values())


def save_in_job(output_dir: str, sd: Dict[str, torch.Tensor], *, stored: list, sharing: list,
                metadata: Optional[dict], safetensors: bool, max_shard_bytes: int, dtype: Optional[torch.dtype],
                configs_of, group=None, durable: bool = True, debug: bool = False) -> None:
    """Write ``sd`` (names ``stored``; the aliases of ``sharing`` are not) as one HF checkpoint, from every rank.

    ``configs_of()``: the config files rank 0 writes (called there only).
    """
    coordinator, rank, world_size = resolve_world(group)
    pg = _torch_group(group) if coordinator is not None else None
    store, root = storage_for(output_dir)
    with contextlib.ExitStack() as locks:
        prep, exc = attempt(lambda: _prepare(sd, stored, dtype, rank, configs_of, store, root, locks))
        agree(coordinator, {"error": describe(exc)}, exc, "preparing and locking the save")
        everyone = [prep["boxes"]] if coordinator is None else exchange(coordinator, prep["boxes"], "sharing layouts")
        tensors = _gather_tensors(sd, stored, dtype, everyone)
        plan = plan_export([(n, _nbytes(t)) for n, t in tensors.items()], world_size, max_shard_bytes, safetensors)
        index_data = export_index(plan.weight_map, {n: _nbytes(t) for n, t in tensors.items()}, metadata, sharing,
                                  safetensors)
        agree(coordinator, {"error": None}, None, "clearing the previous checkpoint",
              on_root=lambda _: remove_previous(store, root))
        _, exc = attempt(lambda: _write_own(store, root, plan, tensors, rank, world_size, pg, safetensors, durable,
                                            debug))
        agree(coordinator, {"error": describe(exc)}, exc, "writing the shard files", root_step="writing the index",
              on_root=lambda _: write_tail(store, root, index_data, safetensors, prep["configs"], durable=durable))


def _prepare(sd, stored, dtype, rank: int, configs_of, store, root: str, locks: contextlib.ExitStack) -> dict:
    """This rank's boxes and a digest of what it would save; rank 0's configs; this rank's writer lock."""
    boxes = []
    for name in stored:
        box, _ = local_box(name, sd[name])
        boxes.append([list(box.offsets), list(box.sizes)] if is_dtensor(sd[name]) else None)
    facts = [[n, list(sd[n].shape), str(out_dtype(sd[n].dtype, dtype))] for n in stored]
    digest = hashlib.sha256(json.dumps(facts).encode()).hexdigest()
    configs = configs_of() if rank == 0 else {}
    locks.enter_context(store.writer_lock(root, slot=rank, holder=_HOLDER))
    return {"boxes": {"digest": digest, "boxes": boxes}, "configs": configs}


def _gather_tensors(sd, stored: list, dtype, everyone: list) -> Dict[str, GatherTensor]:
    """Each stored tensor with every rank's box, after checking the ranks save the same state and cover it."""
    digests = [e["digest"] for e in everyone]
    if len(set(digests)) > 1:
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        raise TensorMismatchError(
            f"rank {other} of the group would save other tensors than rank 0 (names, shapes or dtypes differ); "
            f"save_checkpoint on DTensors is a collective: call it on every rank of the group with the same "
            f"model, or pass group= the ranks that hold one model (e.g. one pipeline stage). Nothing was written.")
    out = {}
    for i, name in enumerate(stored):
        t = sd[name]
        shape = tuple(t.shape)
        boxes = tuple(whole_box(shape) if e["boxes"][i] is None else Box(tuple(e["boxes"][i][0]),
                                                                          tuple(e["boxes"][i][1])) for e in everyone)
        problem = cover_problem(shape, list({b for b in boxes if b.numel}))
        if problem:
            raise TensorMismatchError(
                f"the ranks of the group do not hold all of {name!r} {list(shape)} between them ({problem}); pass "
                f"group= a group whose ranks hold every part of the model (all of the DTensors' mesh). "
                f"Nothing was written.")
        local = t.to_local() if is_dtensor(t) else t
        out[name] = GatherTensor(name, shape, out_dtype(t.dtype, dtype), boxes, local)
    return out


def _write_own(store, root: str, plan: ExportPlan, tensors: Dict[str, GatherTensor], rank: int, world_size: int,
               pg, safetensors: bool, durable: bool, debug: bool) -> None:
    """Write this rank's files while a thread runs every round (also those that only feed other ranks)."""
    sequences = [_sequence(plan, r, tensors) for r in range(world_size)]
    handoff = Handoff()
    failure: list[BaseException] = []

    def rounds() -> None:
        try:
            run_rounds(rounds_of(sequences), tensors, rank, pg, handoff.put)
        except BaseException as e:  # noqa: BLE001 - re-raised on the writing thread below
            failure.append(e)
            handoff.fail(e)

    thread = threading.Thread(target=rounds, name="shardkit-hf-gather", daemon=True)
    thread.start()
    write_error: Optional[BaseException] = None
    try:
        files = [(f.name, f.names) for f in plan.files_of(rank)]
        write_files(store, root, files, lambda n: _taken(handoff, tensors[n]), safetensors, durable=durable,
                    debug=debug)
    except Exception as e:  # noqa: BLE001 - raised below, once the rounds the other ranks need are done
        write_error = e
    finally:
        handoff.close()  # from here the rounds still run for the other ranks, dropping what was ours
        thread.join()
    if failure:  # the cause of a writer's "could not be gathered", if it saw one
        raise failure[0]
    if write_error is not None:
        raise write_error


def _taken(handoff: Handoff, t: GatherTensor) -> LazyTensor:
    return LazyTensor(t.dtype, t.shape, lambda: handoff.take(t.name))


def _sequence(plan: ExportPlan, rank: int, tensors: Dict[str, GatherTensor]) -> list:
    """The names ``rank`` writes, in the order its writer loads them."""
    return [n for f in plan.files_of(rank)
            for n in write_order(list(f.names), lambda n: tensors[n].dtype, lambda n: tensors[n].shape)]


def _nbytes(t: GatherTensor) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n * itemsize_bytes(t.dtype)


def _torch_group(group):
    """The torch ``ProcessGroup`` the bytes travel over: ``group``'s own, or the default group."""
    if group is None:
        return dist.group.WORLD
    pg = getattr(group, "process_group", None) or getattr(group, "pg", None) or group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"group must be None, a torch ProcessGroup or a shardkit comm.Group, got {type(group).__name__}")
    return pg

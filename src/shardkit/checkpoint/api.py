"""``save`` / ``load`` / ``async_save``: the training-loop API, shaped like ``torch.distributed.checkpoint``.

Switching from DCP is a change of import::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import shardkit.checkpoint as ckpt

    model_sd, optim_sd = get_state_dict(model, optimizer)        # FSDP2 / TP: DTensor leaves
    ckpt.save({"model": model_sd, "optim": optim_sd, "step": step}, f"/ckpt/step-{step}")
    ...
    state = {"model": model_sd, "optim": optim_sd, "step": 0}    # from get_state_dict, on any mesh
    ckpt.load(state, "/ckpt/step-100")                           # fills in place
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

``DTensor`` leaves carry their layout (FSDP2, HSDP, TP, 2-D); each distinct
box is written once by one of the ranks that hold it, the writing spread
across ranks. Plain tensors are replicated (written once); plain leaves go
to ``metadata.json``. Rank and world size come from ``group`` (None: the
default process group if initialised, else one process). The format is
version 2 of ``metadata.json`` (``docs/format.md``): every tensor by its
chunks, so any box layout reshards to any other. ``load`` also reads
version-1 and seed-format checkpoints.

What it does not do: it does not build the model/optimizer state (use
``get_state_dict`` / ``set_state_dict``), cast dtypes, or add leaves the
state lacks. Per-rank values that differ between ranks are not kept: plain
leaves come from rank 0 (save such state as a tensor in a DTensor, or in a
per-rank directory).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch.distributed as dist

from shardkit.checkpoint.async_save import _dedicated_gloo_group
from shardkit.checkpoint.future import CheckpointFuture
from shardkit.checkpoint.chunked_save import prepare, write_and_commit
from shardkit.checkpoint.dtensor_layout import local_box, outside_mesh
from shardkit.checkpoint.group import resolve_group
from shardkit.checkpoint.load_into import _leaves, _replace_plain, load_into
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.read_path import open_checkpoint
from shardkit.checkpoint.rank_state import check_reserved, is_rank_state_name, rank_state_targets, warn_world_changed
from shardkit.checkpoint.shutdown import join_at_exit
from shardkit.checkpoint.staging import stage
from shardkit.checkpoint.staging_reserve import StagingReserve
from shardkit.errors import AsyncCheckpointError, TensorMismatchError
from shardkit.storage import storage_for

__all__ = ["save", "load", "async_save", "resolve_world", "start_background", "background_coordinator", "release_staging",
           "reserve_staging", "stage_for_background"]


def resolve_world(group):
    """``(coordinator or None, rank, world_size)`` of ``group``; None: the default group if initialised."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    pg = getattr(group, "process_group", group)
    if pg is None:
        return None, 0, 1
    if hasattr(group, "rank") and hasattr(group, "world_size") and not isinstance(group, dist.ProcessGroup):
        rank, world_size = group.rank, group.world_size
    else:
        rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    return resolve_group(group, rank, world_size), rank, world_size


@logged("save")
def save(state_dict, dir, *, group=None, metadata=None, rank_state=None) -> None:
    """Save ``state_dict`` (nested; DTensor, tensor and plain leaves) into the directory ``dir``.

    A collective over ``group``: every rank calls it with the same structure.
    Returns once the whole checkpoint is committed (``metadata.json`` written
    last). Raises :class:`TensorMismatchError` when ranks disagree on names,
    shapes or dtypes, ``TypeError`` for a leaf that would need pickle.
    ``rank_state``: values that differ between ranks (RNG states, a loader's
    position), kept per rank (see ``rank_state.py`` for the world-size rule).

    >>> save({"model": model_sd, "optim": optim_sd, "step": 7}, "/ckpt/step-7")
    """
    coordinator, rank, world_size = resolve_world(group)
    prep = prepare(state_dict, coordinator, rank, world_size, metadata, rank_state)
    storage, directory = storage_for(dir)
    write_and_commit(prep, storage, directory, coordinator)


def _walk(state_dict):
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict (possibly nested), got {type(state_dict).__name__}")
    return _leaves(state_dict)


@logged("load")
def load(state_dict, dir, *, group=None, strict: bool = True, rank_state=None) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``dir``, whatever mesh or world size saved it.

    Each DTensor leaf receives its local box (only the overlapping byte
    ranges are read), each plain tensor the whole tensor, each plain leaf its
    saved value. A name of ``state_dict`` the checkpoint lacks, a checkpoint
    name ``state_dict`` lacks (unless ``strict=False``), a global shape or a
    dtype that differs raise :class:`TensorMismatchError` before a byte is
    read. No collective is issued; ``group`` gives this rank's number.
    ``rank_state`` (as saved) is filled in place with this rank's saved values
    when the world size is the saving one; otherwise it is left untouched, with
    a ``UserWarning`` (``rank_state.py``).

    >>> model_sd, optim_sd = get_state_dict(model, optimizer)
    >>> load({"model": model_sd, "optim": optim_sd}, "/ckpt/step-7")
    """
    _, rank, world_size = resolve_world(group)   # every rank reads its own boxes: nothing to agree on
    with open_checkpoint(dir) as ck:
        _load_open(state_dict, ck, rank, world_size, strict, rank_state)


def _load_open(state_dict, ck, rank: int, world_size: int, strict: bool, rank_state) -> None:
    m = ck.manifest
    tensors, others = _walk(state_dict)
    check_reserved([*tensors, *others])
    _check_names(set(tensors) | others, {n for n in [*m.tensors, *m.objects] if not is_rank_state_name(n)}, strict)
    boxes, targets = {}, {}
    for name, t in tensors.items():
        saved = m.tensors.get(name)
        if saved is None:
            raise TensorMismatchError(f"state_dict has a tensor {name!r}, but the checkpoint holds a plain value "
                                      f"{m.objects.get(name)!r} there")
        if tuple(t.shape) != tuple(saved.spec.full_shape):
            raise TensorMismatchError(f"tensor {name!r} has global shape {list(t.shape)}, the checkpoint saved "
                                      f"{list(saved.spec.full_shape)}; build the model with the saved shapes")
        box_and_local = local_box(name, t)
        if not outside_mesh(t):  # a rank outside the DTensor's mesh holds nothing of it to fill
            boxes[name], targets[name] = box_and_local
    for name in others:
        if name in m.tensors:
            raise TensorMismatchError(f"state_dict's leaf {name!r} is not a tensor, but the checkpoint holds a "
                                      f"{list(m.tensors[name].spec.full_shape)} tensor there; put a tensor there")
    plain = {}
    if rank_state is not None and m.num_ranks != world_size:
        warn_world_changed(m.num_ranks, world_size)
    elif rank_state is not None:
        extra_targets, extra_boxes, plain = rank_state_targets(rank_state, rank)
        _check_names(set(extra_targets) | set(plain), set(m.tensors) | set(m.objects), strict=False)
        targets.update(extra_targets)
        boxes.update(extra_boxes)
    load_into(targets, ck, 0, 1, keys=None, boxes=boxes)
    _replace_plain(state_dict, "", {n: m.objects[n] for n in others})
    if plain:
        _replace_plain(rank_state, "", {leaf: m.objects[saved] for saved, leaf in plain.items()})


def _check_names(names: set[str], saved: set[str], strict: bool) -> None:
    missing = sorted(names - saved)
    if missing:
        raise TensorMismatchError(f"state_dict has {len(missing)} leaves the checkpoint lacks: "
                                  f"{', '.join(missing[:8])}; the checkpoint holds {', '.join(sorted(saved)[:8])}"
                                  f"{', ...' if len(saved) > 8 else ''}")
    unexpected = sorted(saved - names)
    if unexpected and strict:
        raise TensorMismatchError(
            f"the checkpoint holds {len(unexpected)} leaves state_dict lacks: {', '.join(unexpected[:8])}; "
            f"pass a state_dict with them (an optimizer's state: use get_state_dict, which creates it) or "
            f"strict=False to ignore them")


_BACKGROUND_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BACKGROUND_LOCK = threading.Lock()
# Saves are tracked by their futures' events, never by Thread.is_alive()/join(): on Python 3.11 a
# KeyboardInterrupt inside join() marks a still-running thread as stopped, and a save whose buffers
# were then reused wrote the next step's values under its own step.
_LAST_SAVE: dict[int, CheckpointFuture] = {}       # id(background group) -> its latest save
_STAGING: dict[int, dict] = {}                      # id(background group) -> staging buffers to reuse
_RESERVES: dict[int, StagingReserve] = {}           # id(background group) -> buffers being made ahead


def background_coordinator(group, coordinator, rank: int, world_size: int):
    """A group of its own for the background thread's collectives, made once per training group."""
    if coordinator is None:
        return None
    key = getattr(group, "process_group", group) if group is not None else dist.group.WORLD
    with _BACKGROUND_LOCK:
        own = _BACKGROUND_GROUPS.get(key)
        if own is None:
            own = _dedicated_gloo_group(group if group is not None else dist.group.WORLD)
            _BACKGROUND_GROUPS[key] = own
    return resolve_group(own, rank, world_size)


@logged("async save (staging)")
def async_save(state_dict, dir, *, group=None, metadata=None, rank_state=None) -> CheckpointFuture:
    """Plan and stage now (a copy of this rank's boxes), write in the background; return the future.

    Blocks for one small exchange of layouts over ``group`` and the staging
    copy; the writing and the commit run on a background thread over a Gloo
    group of their own (made once per ``group``, at the first call: every
    rank calls ``async_save`` at the same point), so they never interleave
    with training's collectives. A save started while another is in flight
    queues behind it (saves run in the order started, never two at once).
    The staging buffers (one CPU copy of this rank's boxes) are kept and
    reused by the next save on the same group once this one has finished.
    ``future.wait()`` raises
    :class:`AsyncCheckpointError` if the save failed.

    >>> future = async_save(state, "/ckpt/step-8"); train(); future.wait()
    """
    coordinator, rank, world_size = resolve_world(group)
    prep = prepare(state_dict, coordinator, rank, world_size, metadata, rank_state)
    background = background_coordinator(group, coordinator, rank, world_size)
    stage_for_background(prep, background, dir)
    return start_background(prep, dir, background)


def _key(background) -> int:
    return id(getattr(background, "pg", None) or getattr(background, "process_group", None) or background)


def stage_for_background(prep, background, dir) -> None:
    """Copy the tensors ``prep`` writes into CPU buffers, reusing the last save's on this background
    group when it has finished (no allocation, no page faults: most of what a warm call blocks for).
    The buffers (one CPU copy of this rank's boxes) are kept for the next save.

    A failure (out of host memory) raises :class:`AsyncCheckpointError`; with a group, a background
    save of ``dir`` that only reports it is started first, so the other ranks' saves fail at their
    first exchange instead of waiting for this rank until the group's timeout."""
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)
        idle = previous is None or previous.done()
        buffers = _STAGING.pop(key, {}) if idle else {}
        reserve = _RESERVES.pop(key, None) if idle else None
    unfaulted: set[int] = set()
    if reserve is not None:
        buffers, unfaulted = reserve.take()
    try:
        prep.to_write, used = stage(prep.to_write, buffers, unfaulted=unfaulted)
    except Exception as e:
        if background is not None:
            start_background(prep, dir, background, failed=e)._reported = True  # raised below, not at exit
        raise AsyncCheckpointError(f"staging the save to {dir} failed before anything was written: "
                                   f"{type(e).__name__}: {e}. Free host memory (or save less) and save again") from e
    with _BACKGROUND_LOCK:
        _STAGING[key] = used


def reserve_staging(prep, background) -> None:
    """Start making the staging buffers the next save on ``background`` copies ``prep``'s tensors into:
    allocated and faulted in on a thread of their own (``checkpoint.staging_reserve``), so that save
    blocks only for the copy. Raises :class:`AsyncCheckpointError` while a save on ``background`` is
    in flight (its buffers are busy); replaces an earlier reserve."""
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)
        if previous is not None and not previous.done():
            raise AsyncCheckpointError(f"a background save to {previous.dir} is still in flight; wait for it "
                                       f"before preparing the next one's staging buffers")
        buffers, earlier = _STAGING.pop(key, {}), _RESERVES.pop(key, None)
    unfaulted: set[int] = set()
    if earlier is not None:
        buffers, unfaulted = earlier.take()
    try:
        reserve = StagingReserve(prep.to_write, buffers, unfaulted)
    except Exception as e:  # e.g. "can't start new thread": the kept buffers stay for the next save
        with _BACKGROUND_LOCK:
            _STAGING[key] = buffers
        raise AsyncCheckpointError(f"could not start making the staging buffers in the background: "
                                   f"{type(e).__name__}: {e}. The next save makes them itself") from e
    with _BACKGROUND_LOCK:
        _RESERVES[key] = reserve


def start_background(prep, dir, background, *, before_write=None, after=None,
                     failed: BaseException | None = None) -> CheckpointFuture:
    """Run ``write_and_commit`` for a prepared, staged save on a new thread; ``after()`` runs there
    once the save succeeded (the manager's rotation). The thread is not a daemon: a process whose
    main thread ends still finishes the save before it exits. ``failed``: staging failed on this
    rank; the thread only tells the other ranks, at the save's first exchange (their saves fail
    there), and its future carries that failure."""
    storage, directory = storage_for(dir)
    future = CheckpointFuture(os.fspath(dir), f"background checkpoint save (rank {prep.rank})")
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)

    def run():
        error = None
        try:
            if previous is not None:
                # Saves on one background group run in the order they were started (the same
                # on every rank): two threads issuing collectives on one group would mismatch.
                previous.wait_finished()
            write_and_commit(prep, storage, directory, background, before_write, failed=failed)
            if after is not None:
                after()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            error = e
        finally:
            future._finish(error)

    thread = threading.Thread(target=run, name=f"shardkit-async-save-rank{prep.rank}", daemon=False)
    with _BACKGROUND_LOCK:
        try:
            thread.start()
        except RuntimeError as e:
            raise AsyncCheckpointError(f"could not start the background save thread: {e}") from e
        _LAST_SAVE[key] = future
    join_at_exit(thread, future)
    return future


def release_staging(background) -> None:
    """Free the staging buffers kept for ``background``'s next save, unless a save is still using them."""
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)
        reserve = _RESERVES.pop(key, None)
        if previous is None or previous.done():
            _STAGING.pop(key, None)
    if reserve is not None:
        reserve.take()  # stops its thread; the buffers go with it

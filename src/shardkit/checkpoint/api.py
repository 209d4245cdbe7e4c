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
version 3 of ``metadata.json`` (``docs/format.md``): every tensor by its
chunks (a compact grid where they form one), so any box layout reshards to any other. ``load`` also reads
version-1 and seed-format checkpoints, PyTorch DCP checkpoints and Hugging Face
ones (``checkpoint/load_source.py``), with name mapping, partial loads and casts.

What it does not do: it does not build the model/optimizer state (use
``get_state_dict`` / ``set_state_dict``), cast dtypes unless asked
(``cast=True``), or add leaves the state lacks. Per-rank values that differ
between ranks are not kept: plain leaves come from rank 0 (save such state
as a tensor in a DTensor, or in a per-rank directory).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch.distributed as dist

from shardkit.checkpoint.background.group import dedicated_gloo_group
from shardkit.checkpoint.background.future import CheckpointFuture
from shardkit.checkpoint.saving.chunked_save import prepare, write_and_commit
from shardkit.checkpoint.saving.incremental import base_directory
from shardkit.checkpoint.coordination.group import resolve_group
from shardkit.checkpoint.planning.load_names import LoadOptions
from shardkit.checkpoint.load_source import load_from_source
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.background.shutdown import join_at_exit
from shardkit.checkpoint.background import staged_proof
from shardkit.checkpoint.background.staging import stage_against
from shardkit.checkpoint.background.staging_reserve import StagingReserve
from shardkit.errors import AsyncCheckpointError
from shardkit.sources.opening import open_source
from shardkit.storage import storage_for
from shardkit.storage.fast_io.write_mode import WriteMode

__all__ = ["save", "load", "async_save", "resolve_world", "start_background", "start_background_work",
           "background_coordinator", "release_staging",
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
def save(state_dict, dir, *, group=None, metadata=None, rank_state=None, base=None) -> None:
    """Save ``state_dict`` (nested; DTensor, tensor and plain leaves) into the directory ``dir``.

    A collective over ``group``: every rank calls it with the same structure.
    Returns once the whole checkpoint is committed (``metadata.json`` written
    last). Raises :class:`TensorMismatchError` when ranks disagree on names,
    shapes or dtypes, ``TypeError`` for a leaf that would need pickle.
    ``rank_state``: values that differ between ranks (RNG states, a loader's
    position), kept per rank (see ``rank_state.py`` for the world-size rule).

    ``base``: an incremental save (format version 3). ``base`` is a complete
    checkpoint directory beside ``dir`` (same parent folder or URL prefix);
    each chunk whose bytes equal, byte for byte, the base's chunk of the same
    tensor and box is referenced instead of written (``checkpoint/saving/incremental.py``).
    The new checkpoint then needs the base (and what the base references) to
    load: keep it (``CheckpointManager(incremental=True)`` does), or a load
    raises :class:`MissingBaseError` naming it. Not for ``dir == base``.

    >>> save({"model": model_sd, "optim": optim_sd, "step": 7}, "/ckpt/step-7")
    >>> save({"model": model_sd, "optim": optim_sd, "step": 8}, "/ckpt/step-8", base="/ckpt/step-7")
    """
    coordinator, rank, world_size = resolve_world(group)
    prep = prepare(state_dict, coordinator, rank, world_size, metadata, rank_state)
    storage, directory = storage_for(dir)
    if base is not None:
        prep.base_dir = base_directory(storage, directory, os.fspath(base))
    write_and_commit(prep, storage, directory, coordinator)


@logged("load")
def load(state_dict, dir, *, group=None, strict: bool = True, rank_state=None, cast: bool = False,
         prefix: str | None = None, rename=None, allow_partial: bool = False, exclude=()) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``dir``: shardkit's own (every version), a PyTorch
    DCP one or a Hugging Face one, whatever mesh or world size saved it.

    The format is the one detector's (``shardkit.format_detect``: ``metadata.json``, then a Hugging Face
    weights file or index, then DCP's ``.metadata``). Each DTensor leaf receives its local box (only the
    bytes of that box are read: safetensors rows, DCP records), each plain tensor the whole tensor, each
    plain leaf its saved value. ``.bin`` files are read through ``torch.load(weights_only=True)`` and DCP's
    ``.metadata`` through a restricted unpickler: nothing runs code from the checkpoint, nothing in it is
    changed. Names, global shapes, dtypes and file headers are checked before a byte is read
    (:class:`TensorMismatchError`, or the format's typed errors for damaged files).

    - ``strict``: a checkpoint leaf ``state_dict`` lacks is an error (False: ignored);
    - ``allow_partial``: a ``state_dict`` leaf the checkpoint lacks is left untouched (default: an error);
    - ``exclude``: glob patterns (``fnmatch``; ``*`` crosses dots) on state names: leaves neither read nor
      required, checkpoint names that map there ignored;
    - ``prefix``: state name ``N`` is read from checkpoint name ``prefix + N``; checkpoint names without
      the prefix are outside the load. ``prefix="model."`` loads the ``model`` part of a training
      checkpoint into a bare ``model.state_dict()``, or an HF ``*ForCausalLM`` checkpoint into its base
      model; for the other direction (a state whose names carry more, e.g. ``module.``) pass ``rename``,
      or load into the sub-dict (``state["model"]``);
    - ``rename(checkpoint_name) -> state_name | None``: any mapping (None skips that checkpoint name),
      applied after ``prefix``;
    - ``cast``: a checkpoint tensor of another floating dtype is converted into the state's dtype (bf16
      weights into fp32 parameters), read a box at a time into a temporary; without it, an error naming
      ``cast=True``;
    - tied weights a Hugging Face checkpoint stores once (``lm_head.weight`` with
      ``model.embed_tokens.weight``) fill both names.

    No collective is issued; ``group`` gives this rank's number. ``rank_state`` (shardkit checkpoints, as
    saved) is filled in place with this rank's saved values when the world size is the saving one;
    otherwise, or for another format, it is left untouched with a ``UserWarning`` (``rank_state.py``).

    >>> model_sd, optim_sd = get_state_dict(model, optimizer)
    >>> load({"model": model_sd, "optim": optim_sd}, "/ckpt/step-7")
    >>> load(get_model_state_dict(fsdp_model), "llama-hf", cast=True)     # bf16 HF weights, fp32 FSDP2
    """
    _, rank, world_size = resolve_world(group)   # every rank reads its own boxes: nothing to agree on
    options = LoadOptions(strict=strict, cast=cast, prefix=prefix, rename=rename, allow_partial=allow_partial,
                          exclude=exclude)
    with open_source(os.fspath(dir), verify=None) as source:
        load_from_source(state_dict, source, rank, world_size, options, rank_state)


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
            own = dedicated_gloo_group(group if group is not None else dist.group.WORLD)
            _BACKGROUND_GROUPS[key] = own
    return resolve_group(own, rank, world_size)


@logged("async save (staging)")
def async_save(state_dict, dir, *, group=None, metadata=None, rank_state=None, base=None) -> CheckpointFuture:
    """Plan and stage now (a copy of this rank's boxes), write in the background; return the future.

    Blocks for one small exchange of layouts over ``group`` and the staging
    copy; the writing and the commit run on a background thread over a Gloo
    group of their own (made once per ``group``, at the first call: every
    rank calls ``async_save`` at the same point), so they never interleave
    with training's collectives. A save started while another is in flight
    queues behind it (saves run in the order started, never two at once).
    The staging buffers (one CPU copy of this rank's boxes) are kept and
    reused by the next save on the same group once this one has finished.
    The files are written with ``O_DIRECT``, as by :func:`save`, or through
    the page cache with ``knobs.BACKGROUND_DIRECT_IO = False``, at a share of
    the disk's speed (``knobs.BACKGROUND_DISK_SHARE``, a tenth by default),
    so that training on the same machine barely slows while the save runs.
    ``future.wait()`` raises
    :class:`AsyncCheckpointError` if the save failed. ``base``: an incremental
    save, as for :func:`save` (the staged copy is compared in the background).

    >>> future = async_save(state, "/ckpt/step-8"); train(); future.wait()
    """
    coordinator, rank, world_size = resolve_world(group)
    prep = prepare(state_dict, coordinator, rank, world_size, metadata, rank_state)
    if base is not None:
        prep.base_dir = base_directory(*storage_for(dir), os.fspath(base))
    background = background_coordinator(group, coordinator, rank, world_size)
    stage_for_background(prep, background, dir)
    return start_background(prep, dir, background)


def _key(background) -> int:
    return id(getattr(background, "pg", None) or getattr(background, "process_group", None) or background)


def stage_for_background(prep, background, dir) -> None:
    """Copy the tensors ``prep`` writes into CPU buffers, reusing the last save's on this background
    group when it has finished (no allocation, no page faults: most of what a warm call blocks for).
    The buffers (one CPU copy of this rank's boxes) are kept for the next save. The save is written
    as the knobs say (``WriteMode.background()``: ``BACKGROUND_DIRECT_IO``, ``BACKGROUND_DISK_SHARE``;
    a share outside (0, 1] raises ``ValueError`` here, before anything is staged).

    A failure (out of host memory) raises :class:`AsyncCheckpointError`; with a group, a background
    save of ``dir`` that only reports it is started first, so the other ranks' saves fail at their
    first exchange instead of waiting for this rank until the group's timeout."""
    prep.write_mode = WriteMode.background()    # knobs.BACKGROUND_DIRECT_IO and BACKGROUND_DISK_SHARE
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)
        idle = previous is None or previous.done()
        buffers = _STAGING.pop(key, {}) if idle else {}
        reserve = _RESERVES.pop(key, None) if idle else None
    last = staged_proof.take(key)    # the buffers are overwritten from here on
    unfaulted: set[int] = set()
    if reserve is not None:
        buffers, unfaulted = reserve.take()
    storage = storage_for(dir)[0]
    proving = staged_proof.comparable(last, prep, storage, buffers)
    try:
        prep.to_write, used, same = stage_against(prep.to_write, buffers, compare={(n,) for n in proving},
                                                  unfaulted=unfaulted)
    except Exception as e:
        if background is not None:
            start_background(prep, dir, background, failed=e).mark_reported()  # raised below, not at exit
        raise AsyncCheckpointError(f"staging the save to {dir} failed before anything was written: "
                                   f"{type(e).__name__}: {e}. Free host memory (or save less) and save again") from e
    prep.proven = {path[0]: proving[path[0]].where for path in same}
    with _BACKGROUND_LOCK:
        _STAGING[key] = used


def reserve_staging(prep, background) -> None:
    """Start making the staging buffers the next save on ``background`` copies ``prep``'s tensors into:
    allocated and faulted in on a thread of their own (``checkpoint.background.staging_reserve``), so that save
    blocks only for the copy. Raises :class:`AsyncCheckpointError` while a save on ``background`` is
    in flight (its buffers are busy); replaces an earlier reserve."""
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)
        if previous is not None and not previous.done():
            raise AsyncCheckpointError(f"a background save to {previous.dir} is still in flight; wait for it "
                                       f"before preparing the next one's staging buffers")
        buffers, earlier = _STAGING.pop(key, {}), _RESERVES.pop(key, None)
    staged_proof.take(key)    # the buffers go to the reserve: nothing proves with them any more
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

    def work():
        write_and_commit(prep, storage, directory, background, before_write, failed=failed)
        if failed is None:    # committed: its staging buffers may prove the next incremental save
            staged_proof.keep(_key(background), staged_proof.committed(prep, storage, directory))
        if after is not None:
            after()

    future = CheckpointFuture(os.fspath(dir), f"background checkpoint save (rank {prep.rank})",
                              hurry=prep.write_mode.hurry)
    return start_background_work(work, dir, background, prep.rank, future=future)


def start_background_work(work, dir, background, rank: int, *, future: CheckpointFuture | None = None
                          ) -> CheckpointFuture:
    """The one background save engine: run ``work()`` (a save of ``dir`` whose collectives, if any, go
    over ``background``) on a new non-daemon thread, after every save started before on ``background``
    has finished (the same order on every rank); ``future`` (a new one if None) carries its outcome.
    ``start_background`` and ``AsyncCheckpointer`` run their saves here. Raises
    :class:`AsyncCheckpointError` if the thread cannot start (``work`` never runs)."""
    if future is None:
        future = CheckpointFuture(os.fspath(dir), f"background checkpoint save (rank {rank})")
    key = _key(background)
    with _BACKGROUND_LOCK:
        previous = _LAST_SAVE.get(key)

    def run():
        error = None
        try:
            if previous is not None:
                # Saves on one background group run in the order they were started (the same
                # on every rank): two threads issuing collectives on one group would mismatch.
                # Waiting lifts the earlier save's pace: saves are queueing, each holding a copy.
                previous.wait_finished()
            work()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            error = e
        finally:
            future.finish(error)

    thread = threading.Thread(target=run, name=f"shardkit-async-save-rank{rank}", daemon=False)
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
            staged_proof.take(key)    # it holds the buffers too
    if reserve is not None:
        reserve.take()  # stops its thread; the buffers go with it

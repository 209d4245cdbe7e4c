"""``CheckpointManager``: a run's checkpoints, one directory per step, complete ones only.

``root/step-<n>/`` holds the checkpoint of step ``n`` (written by
:func:`~shardkit.checkpoint.save`'s engine, format version 3). Rules:

- **Complete only**: a step counts once its ``metadata.json`` is committed
  and every data file it records exists with the recorded size; steps are
  ordered by their number, never by mtime. A save interrupted by a crash
  (even SIGKILL) leaves an incomplete directory that :meth:`restore`
  ignores; it is deleted by a later rotation once a newer step is complete
  (with the temporaries and incomplete uploads killed saves left under
  ``root``), or cleared when the same step is saved again. A read that
  fails for another reason (an I/O error, a server's 500) is never taken
  for "incomplete": :meth:`restore` and :meth:`steps` raise it, and that
  round's rotation deletes nothing (it is logged; the next one tries again).
- **Rotation** (rank 0 only, on the background save thread, or a thread of
  its own for blocking saves; never on the training thread) keeps the
  ``keep_last`` newest complete steps and the best one by ``best``; it never
  deletes the newest complete step or a step being written.
- **It deletes only what it can prove it wrote**: each of its saves marks
  the step directory (``.shardkit-checkpoint``, see ``checkpoint.format.ownership``)
  before any rank writes a data byte. A ``step-<n>`` directory without that mark, a writer lock or
  shardkit's committed ``metadata.json`` (a PyTorch DCP or Hugging Face
  checkpoint, a user's files) is never deleted, cleared or saved into
  (saving that step raises :class:`CheckpointError`); it is logged once with
  why. Files someone added to one of its own steps stay when the step is
  rotated. Incomplete uploads are aborted only under its own steps.
- **One save at a time**: :meth:`save` while a save is in flight first
  waits for it (and raises its failure as
  :class:`~shardkit.errors.AsyncCheckpointError`).
- **Groups**: every rank of ``group`` calls ``save`` / ``restore`` at the
  same point; ``restore`` uses rank 0's choice of step.
- **Where**: ``root`` is a local (or shared, mounted) directory or any URL
  :func:`~shardkit.storage.storage_for` takes (``s3://``, ``gs://``,
  ``memory://``, ``file://``); every listing, size check and deletion goes
  through that storage. On an object store a "directory" is a key prefix,
  a crashed save's orphans include its incomplete multipart uploads (aborted
  at the next rotation), and no writer lock is held (``Storage.writer_lock``): run
  one manager per ``root``.

Example::

    with CheckpointManager("/ckpt/run1", keep_last=2, best=("loss", "min")) as mgr:
        last = mgr.restore(state)                # state from get_state_dict; None on a fresh run
        mgr.prepare(state)                       # optional: the first save's host memory, made in the background
        for step in range(0 if last is None else last + 1, steps):
            ...
            if step % 100 == 0:
                mgr.save(step, state, metrics={"loss": loss})

**Incremental** (``incremental=True``): each save names the newest complete
step this manager wrote as its base (``save(..., base=)``): chunks whose bytes
did not change are referenced there, not written again (``full_every=n``: a
full save once ``n - 1`` incremental ones follow the last full step).
Rotation never removes a step a kept step references; it frees it once no
kept step does.

A step already saved complete is never saved again (``CheckpointExistsError``):
its directory would be cleared before the new copy is written, and a crash
then would leave no checkpoint of it. Nor is a step older than a complete
one (``CheckpointError``): rotation orders steps by number.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from shardkit.checkpoint.api import (
    background_coordinator, load, release_staging, reserve_staging, resolve_world, stage_for_background,
    start_background,
)
from shardkit.checkpoint.saving.chunked_save import prepare, write_and_commit
from shardkit.checkpoint.coordination.group import rank0_decides
from shardkit.checkpoint.manager.metrics import best_step, encode_metrics, parse_best
from shardkit.checkpoint.manager.rotation import (
    NOT_COMPLETE, STEP_DIR, keep_referenced, own_step_complete, remove_step, remove_step_dir, save_problem,
    check_rotation_options, choose_base, step_dir_name, steps_to_remove,
)
from shardkit.checkpoint.format.manifest_cache import ManifestCache
from shardkit.checkpoint.format.ownership import mark_owned, owned_listing, sample_names
from shardkit.errors import (
    AsyncWaitTimeout, CheckpointError, CheckpointExistsError, MetadataError,
)
from shardkit.sources.completeness import complete_kind
from shardkit.storage import is_temp_name, storage_for
from shardkit.storage.json_io import NON_FINITE

__all__ = ["CheckpointManager", "step_dir_name"]

_KEY = "shardkit.manager"
log = logging.getLogger(__name__)


class CheckpointManager:
    """Save every few steps (in the background), keep the last few and the best, restore the latest.

    ``best``: None, a metric name (lower is better) or ``(name, "min" | "max")``;
    the step with the best value of that metric (given to :meth:`save`) is kept.
    """

    def __init__(self, root, *, group=None, keep_last: int = 3, best=None, async_save: bool = True,
                 incremental: bool = False, full_every: int | None = None):
        check_rotation_options(keep_last, full_every)
        self._storage, self.root = storage_for(os.fspath(root))
        self.group, self.keep_last, self.async_save = group, keep_last, async_save
        self.incremental, self.full_every = incremental, full_every
        self._base: int | None = None   # the base of the save in flight (kept by rotation)
        self.best = parse_best(best)
        self._coordinator, self.rank, self.world_size = resolve_world(group)
        self._future = None
        self._rotation: threading.Event | None = None  # set when the blocking save's rotation is over
        self._background = None  # the group background saves use (None: one process)
        self._writing: int | None = None
        self._closed = False
        self._logged_steps: set[int] = set()  # steps whose foreign files were reported (once each)
        self._manifests = ManifestCache()  # each rotation reads every kept step's manifest: parse each once
        if self.rank == 0:
            self._storage.makedirs(self.root)

    # --- what is there ---------------------------------------------------------

    def steps(self) -> list[int]:
        """The complete steps, ascending (a step being written or a crashed one is not listed).

        A read that fails for another reason than a missing or incomplete
        step (an I/O error, a server error) is raised, never taken for
        "incomplete"; so is it by :meth:`latest_step` and :meth:`restore`.
        """
        return [s for s in self._all_steps() if s != self._writing and self._complete_any(s)]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        return self._storage.join(self.root, step_dir_name(step))

    # --- save / restore --------------------------------------------------------

    def save(self, step: int, state_dict, *, metrics: dict | None = None, rank_state=None) -> None:
        """Save ``state_dict`` as step ``step``; waits for a save still in flight first.

        With ``async_save=True`` it returns once the state is staged (the
        write, commit and rotation run in the background; :meth:`wait` for
        them); else once the checkpoint is committed (rotation runs on a
        thread). ``metrics`` (numbers: int, float, or a one-element tensor
        or numpy scalar, read with ``.item()``; a NaN or infinite loss is
        kept, as :meth:`metrics` gives it back) are stored with the step;
        ``rank_state`` as for :func:`~shardkit.checkpoint.save`. A failure to
        delete old steps is logged, not raised: the step is committed, and the
        next rotation tries again.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**18:
            raise MetadataError(f"step must be an integer from 0 to 10**18 - 1, got {step!r}")
        metadata = {_KEY: {"step": step, "metrics": encode_metrics(metrics)}}
        self.wait()
        self._refuse_to_save(step)
        prep = prepare(state_dict, self._coordinator, self.rank, self.world_size, metadata, rank_state)
        directory = self.step_dir(step)
        self._base = self._rank0_decides(lambda: self._base_for(step), "choosing the base") if self.incremental \
            else None
        prep.base_dir = None if self._base is None else self.step_dir(self._base)
        clear = lambda: self._clear_leftover(step)  # noqa: E731 - rank 0, before anything is written
        self._writing = step
        if self.async_save:
            self._future = self._save_in_background(prep, directory, clear)
            return
        try:
            write_and_commit(prep, self._storage, directory, self._coordinator, clear)
        finally:
            self._writing = None
        if self.rank == 0:
            self._rotation = done = threading.Event()
            threading.Thread(target=lambda: (self._rotate_logged(), done.set()), name="shardkit-ckpt-rotate",
                             daemon=False).start()

    def _save_in_background(self, prep, directory: str, clear):
        background = background_coordinator(self.group, self._coordinator, self.rank, self.world_size)
        self._background = background
        try:
            stage_for_background(prep, background, directory)  # AsyncCheckpointError when it fails
        except BaseException:
            self._writing = None
            raise
        return start_background(prep, directory, background, before_write=clear, after=self._after_save)

    def restore(self, state_dict, step: int | None = None, *, rank_state=None, **load_options) -> int | None:
        """Load step ``step`` (default: the latest complete one) into ``state_dict`` in place.

        Returns the step restored, or None when there is none (a fresh run).
        Works on any world size. Raises :class:`CheckpointError` when ``step``
        is given but not complete, and the error of a read that failed while
        rank 0 chose the step (never an older step instead: see :meth:`steps`).
        ``rank_state`` and ``load_options`` (``strict=False`` and the other
        options of :func:`~shardkit.checkpoint.load`) as for that function::

            mgr.restore(state, strict=False)       # the optimizer's state on disk, not in ``state``
        """
        self.wait()
        chosen, problem = self._rank0_decides(lambda: self._restore_choice(step), "choosing the step to restore")
        if problem is not None:
            raise CheckpointError(problem)
        if chosen is None:
            return None
        load(state_dict, self.step_dir(chosen), group=self.group, rank_state=rank_state, **load_options)
        return chosen

    def prepare(self, state_dict, *, rank_state=None) -> None:
        """Start making the host memory the first background save copies into; return at once.

        Optional, for ``async_save=True`` (else it does nothing): the first
        :meth:`save` otherwise allocates one host copy of this rank's part of
        the state and faults every page of it in while training waits. This
        plans the save of ``state_dict`` (one small exchange over ``group``:
        every rank calls it at the same point, as for :meth:`restore`) and
        allocates and faults in the buffers on a thread of its own while
        training goes on; the first save uses what is ready and does the rest.
        The memory is held from now on, as it is after a first save.
        """
        self._check_open()
        if not self.async_save:
            return
        self.wait()
        prep = prepare(state_dict, self._coordinator, self.rank, self.world_size, None, rank_state)
        self._background = background_coordinator(self.group, self._coordinator, self.rank, self.world_size)
        reserve_staging(prep, self._background)

    def _restore_choice(self, step: int | None) -> list:
        """``[step to restore or None, why it cannot be restored or None]``; rank 0's choice."""
        chosen = self.latest_step() if step is None else step
        if chosen is None or step is None or self._complete_any(chosen):
            return [chosen, None]
        return [chosen, f"step {chosen} has no complete checkpoint under {self.root}; complete steps: "
                        f"{self.steps() or 'none'}"]

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step`` (a NaN or infinite value comes back as that float)."""
        m = self._manifests.read(self._storage, self.step_dir(step))
        saved = dict((m.user_metadata.get(_KEY) or {}).get("metrics") or {})
        return {k: NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in saved.items()}

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save and rotation in flight, if any; raise a failed save's error.

        ``timeout`` (seconds): raise :class:`~shardkit.errors.AsyncWaitTimeout`
        if they are still running then (they go on; wait again). Interrupted
        (Ctrl-C), it changes nothing: the save goes on, and the next
        ``wait()``, ``save()`` or ``close()`` waits for it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self._future
        if future is not None:
            try:
                future.wait(_left_s(deadline))
            finally:
                if future.done():  # finished or failed: not on a timeout or an interrupt
                    self._future, self._writing = None, None
        rotation = self._rotation
        if rotation is not None:
            if not rotation.wait(_left_s(deadline)):
                raise AsyncWaitTimeout(f"removing old checkpoints under {self.root} is still running after "
                                       f"{timeout} s; it goes on: call wait() again")
            self._rotation = None

    def close(self) -> None:
        """Wait for everything in flight (see :meth:`wait`), then free the staging buffers; idempotent.

        Interrupted while a save runs, the manager stays open (call it again).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            if self._future is None:  # nothing runs any more, even if it failed
                self._closed = True
                if self.async_save:
                    release_staging(self._background)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except CheckpointError:
            if exc_type is None:
                raise

    # --- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one to save again")

    def _all_steps(self) -> list[int]:
        # Temporary names (``storage.temp_name``: ``.step-3.<hex>.tmp``) never match.
        try:
            names = self._storage.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(STEP_DIR.fullmatch, names) if m)

    def _complete_any(self, step: int) -> bool:
        """Whether ``step`` is complete as shardkit's checkpoint or another format ``load`` reads
        (a torchtitan DCP ``step-N``, a Hugging Face export); any failed read but "incomplete" is raised."""
        return self._complete(step) or complete_kind(self.step_dir(step)) in ("dcp", "hf")

    def _base_for(self, step: int) -> int | None:
        """The newest complete step older than ``step`` that this manager wrote (None: save in full)."""
        own = [s for s in reversed(self._all_steps()) if s < step and self._complete(s) and self._owned(s)]
        return choose_base(self._storage, self.root, own, self.full_every, read=self._manifests.read)

    def _complete(self, step: int) -> bool:
        return own_step_complete(self._storage, self.step_dir(step), read=self._manifests.read)

    def _rank0_decides(self, decide, what: str):
        return rank0_decides(self._coordinator, self.rank, decide, f"{what} under {self.root}")

    def _after_save(self) -> None:
        self._writing = None
        if self.rank == 0:
            self._rotate_logged()

    def _rotate_logged(self) -> None:
        """Rotate; a failure is logged, since the step just saved is committed whatever happens here."""
        try:
            self._rotate()
        except Exception as e:  # noqa: BLE001 - e.g. EIO or EACCES deleting an old step
            log.warning("the newest step under %s is saved and complete, but removing old checkpoints failed "
                        "(%s: %s); they stay on disk until the next save's rotation removes them",
                        self.root, type(e).__name__, e)

    def _refuse_to_save(self, step: int) -> None:
        """Raise, on every rank (rank 0 decides), where saving ``step`` could cost what is there
        (``manager_rotation.save_problem``): ``CheckpointExistsError`` for a complete ``step``."""
        problem = self._rank0_decides(lambda: self._save_problem(step), "checking the step can be saved")
        if problem is not None:
            kind, message = problem
            raise (CheckpointExistsError if kind == "exists" else CheckpointError)(message)

    def _save_problem(self, step: int) -> list[str] | None:
        # One listing, and a manifest read only for this step and newer ones (usually none).
        newer = sorted((s for s in self._all_steps() if s >= step), reverse=True)
        return save_problem(self._storage, self.root, step, newer, self._complete_any)

    def _clear_leftover(self, step: int) -> None:
        # Rank 0, before any rank writes: a crashed or older save of the same step goes (under this
        # save's writer lock, which stays: removing it would let a second writer in), then the mark
        # that makes the directory provably this manager's, whenever the save is cut short.
        remove_step_dir(self._storage, self.step_dir(step), keep_locks=True)
        mark_owned(self._storage, self.step_dir(step))

    def _rotate(self) -> None:
        writing = self._writing
        complete = self.steps()
        best = best_step(complete, self.metrics, self.best, skip=NOT_COMPLETE)
        # Complete steps of other formats count for keep_last and restore, but are never removed.
        owned = [s for s in self._all_steps() if s != writing and self._owned(s)]
        remove = steps_to_remove(owned, complete, keep_last=self.keep_last, best=best, writing=writing)
        needed = (self._base,) if writing is not None and self._base is not None else ()
        for step in keep_referenced(self._storage, self.root, remove, complete, needed, read=self._manifests.read):
            self._remove_step(step)
        if complete and writing is None:
            # What killed saves left that no step lists: temporaries beside the steps, and on object
            # stores incomplete uploads. Nothing of this manager's is being written now: a save waits
            # for the rotation. Only uploads under its own names (a temporary, a step it marked): root
            # may be a bucket other jobs write to, or a run folder another tool saves steps in.
            mine = {step_dir_name(s) for s in owned}
            self._storage.remove_orphans(self.root, uploads_of=lambda name: is_temp_name(name) or name in mine)

    def _owned(self, step: int) -> bool:
        """Whether ``step``'s directory provably is a shardkit save's (``ownership.owned_listing``);
        another tool's (or a user's) is logged once and left alone."""
        owned, names = owned_listing(self._storage, self.step_dir(step))
        if not owned and names:
            self._log_once(step, f"leaving {self.step_dir(step)} alone: it holds no mark of a shardkit save "
                                 f"({sample_names(names)}), so shardkit did not write it (another tool's "
                                 f"checkpoint, or a user's files)")
        return owned

    def _remove_step(self, step: int) -> None:
        kept = remove_step(self._storage, self.step_dir(step))
        if kept:
            self._log_once(step, f"removed shardkit's files of {self.step_dir(step)} but kept what it did not "
                                 f"write there: {sample_names(kept)}")

    def _log_once(self, step: int, message: str) -> None:
        if step not in self._logged_steps:
            self._logged_steps.add(step)
            log.warning(message)


def _left_s(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())

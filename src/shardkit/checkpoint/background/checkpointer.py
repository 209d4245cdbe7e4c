"""Background checkpoint saves: stage on the caller's thread, write on another.

:class:`AsyncCheckpointer` copies every tensor leaf of a state into CPU
staging buffers (pinned host memory for CUDA tensors; non-blocking copies,
then one synchronize per device) and returns a :class:`CheckpointFuture`
at once; a background thread then writes the staged copy with
:func:`shardkit.checkpoint.save_distributed`, i.e. format version 3 through
the one write engine ``save`` and ``async_save`` use, on the one background
engine they use (``api.start_background_work``: a non-daemon thread, saves
on one group run in the order started). The checkpoint therefore holds the
values as they were when :meth:`AsyncCheckpointer.save_async` returned,
however the caller changes the tensors afterwards. ``save_async`` issues no
collective on the caller's thread: the ranks agree on the layout on the
background thread, over the checkpointer's group.

What it does not do: it does not run two saves at once (a second
``save_async`` while one is in flight raises
:class:`~shardkit.errors.AsyncCheckpointError`; call ``wait()`` first), it
does not copy plain (non-tensor) leaves (they are immutable values; only the
containers are rebuilt), and it does not retry a failed save. Saving into
the directory of an existing checkpoint withdraws that checkpoint first
(as ``save_distributed`` does): give each save its own ``dir`` to keep the
previous one loadable while the next is written.

Overwriting. ``save_async(state)`` with no ``dir`` re-saves into the
constructor's ``dir``. That always works with a group (the ranks agree, the
overwrite is crash-safe) and with ``world_size == 1``. Several ranks without
a group get :class:`~shardkit.errors.CheckpointExistsError` (raised by
``save_async`` itself, nothing staged) once the directory holds their files
of an earlier save, because a re-save cut short there can leave a mix of old
and new shards that loads (see ``save_distributed``): pass ``dir=`` per save,
or ``overwrite=True`` (to the constructor, or to one ``save_async``) to
accept that risk. Another save writing the same directory makes the
background save fail with a ``CheckpointBusyError`` cause.

Staging buffers are kept between saves and reused when a leaf's shape,
dtype and device kind are unchanged, so the second and later saves skip the
allocation (for CUDA, the slow pinned allocation). That costs one CPU copy
of the state for the checkpointer's lifetime; ``reuse_buffers=False`` or
:meth:`AsyncCheckpointer.close` gives it back. The first save faults its new
host buffers in on helper jobs running ahead of the copy (see
``checkpoint.background.staging``); ``prepare()`` moves even that out of the first
save, and ``prepare(state, background=True)`` off the caller's thread.

Groups. With ``group=None`` no collective is issued (the seed's behaviour;
rank 0 of 1 in a single process). With a group, the background thread runs
the save's collectives while the caller keeps training, so they must not
interleave with the caller's own collectives on the same group: two threads
issuing collectives on one process group can pair up different operations
across ranks and hang or corrupt both. By default (``dedicated_group=True``)
the checkpointer therefore creates its own Gloo group over the same ranks,
once, in the constructor (``torch.distributed.new_group(...,
use_local_synchronization=True)``: every member rank must construct its
checkpointer at the same point of the program, as it must anyway; ranks
outside the group need not take part). That group lives until the default
process group is destroyed (see ``_destroy_own_group`` for why), so create
one checkpointer per group and reuse it rather than one per save. Gloo is also what the save's
collectives need, since they move CPU data, even when training uses NCCL.
A shardkit ``comm.Group`` is ``split`` over all its ranks instead (same
rule: every member constructs its checkpointer at the same point). A raw
torch ProcessGroup must be one ``torch.distributed`` knows (the default group
or one from ``new_group``). Otherwise pass ``dedicated_group=False`` and a
group that nothing else uses while a save is in flight.

Example::

    ckpt = AsyncCheckpointer("/ckpt", rank, world_size, spec, group=dist.group.WORLD)
    future = None
    for step in range(steps):
        train_step()
        if step % 1000 == 0:
            if future is not None:
                future.wait()  # one save at a time; raises AsyncCheckpointError if it failed
            future = ckpt.save_async(model.state_dict(), dir=f"/ckpt/step-{step}")
            # training goes on; the checkpoint holds the values of this step
    ckpt.close()               # waits for the last save; or: with AsyncCheckpointer(...) as ckpt:
"""

from __future__ import annotations

import os
import threading

import torch

from shardkit.checkpoint.api import start_background_work
from shardkit.checkpoint.background.group import dedicated_gloo_group
from shardkit.checkpoint.saving.distributed_save import check_may_overwrite, report_failed_save, save_distributed
from shardkit.checkpoint.background.future import CheckpointFuture
from shardkit.checkpoint.format.nested import flatten
from shardkit.checkpoint.background.staging import stage
from shardkit.checkpoint.background.staging_reserve import StagingReserve
from shardkit.errors import AsyncCheckpointError, AsyncWaitTimeout
from shardkit.storage.fast_io.write_mode import WriteMode

__all__ = ["AsyncCheckpointer", "CheckpointFuture", "AsyncWaitTimeout"]

def _save_staged(staged, dir, rank, world_size, shard_spec, group, *, overwrite: bool, mode: WriteMode) -> None:
    save_distributed(staged, dir, rank, world_size, shard_spec, group=group, overwrite=overwrite, write_mode=mode)


class AsyncCheckpointer:
    """Save distributed checkpoints in the background while training goes on.

    ``dir``, ``rank``, ``world_size``, ``shard_spec``, ``group`` and
    ``overwrite`` mean what they mean for
    :func:`~shardkit.checkpoint.save_distributed`; ``dir`` is the default
    target of :meth:`save_async`, ``overwrite`` the default of its own
    ``overwrite``. See the module docstring for what it does not do, for how
    it treats ``group``, and for re-saving into the same ``dir``.

    Example::

        with AsyncCheckpointer(path, rank, world_size, spec, group=group) as ckpt:
            ckpt.save_async(state).wait()
    """

    def __init__(self, dir, rank: int, world_size: int, shard_spec, *, group=None,
                 dedicated_group: bool = True, reuse_buffers: bool = True, overwrite: bool = False):
        self.dir = os.fspath(dir)
        self.overwrite = overwrite
        self.rank = rank
        self.world_size = world_size
        self.shard_spec = shard_spec
        self.reuse_buffers = reuse_buffers
        self._own_group = None
        if group is not None and dedicated_group:
            self._own_group = dedicated_gloo_group(group)
        self.group = self._own_group if self._own_group is not None else group
        self._lock = threading.Lock()
        self._in_flight: CheckpointFuture | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._reserve: StagingReserve | None = None  # a background prepare()'s buffers, until a save takes them
        self._closed = False

    def save_async(self, state_dict, *, dir=None, overwrite: bool | None = None) -> CheckpointFuture:
        """Stage ``state_dict`` to CPU memory now, write it in the background; return its future.

        Blocks only for the staging copy. Raises ``AsyncCheckpointError`` at once
        if a save is still in flight, if the checkpointer is closed, or if
        staging fails (e.g. out of host memory), and ``CheckpointExistsError``
        for a refused overwrite (``overwrite``: None takes the constructor's;
        see the module docstring); nothing is written then.
        """
        target = self.dir if dir is None else os.fspath(dir)
        overwrite = self.overwrite if overwrite is None else overwrite
        self._check_overwrite(target, overwrite)
        mode = WriteMode.background()   # the knobs' pace (ValueError for a bad one, before anything is claimed)
        future = self._claim(target, mode)
        try:
            staged = self._stage_checked(state_dict)
        except BaseException as e:
            self._staging_failed(future, target, e)
            raise AsyncCheckpointError(
                f"staging the state for the save to {target} failed before anything was written: "
                f"{type(e).__name__}: {e}"
            ) from e
        self._start(future, target, lambda: _save_staged(staged, target, self.rank, self.world_size,
                                                         self.shard_spec, self.group, overwrite=overwrite, mode=mode))
        return future

    def prepare(self, state_dict, *, background: bool = False) -> None:
        """Allocate the staging buffers for a state shaped like ``state_dict`` now; write nothing.

        Optional: the first ``save_async`` otherwise pays for allocating (and,
        for CUDA tensors, pinning) one host copy of the state, and for faulting
        every page of it in, while the caller waits. ``background=False``
        does it all before returning (call it at start-up, when a pause costs
        nothing). ``background=True`` returns at once and does it on a thread
        of its own (``checkpoint.background.staging_reserve``) while training goes on; the
        next ``save_async`` takes over what is ready and faults in the rest
        itself, so calling it too late costs nothing extra. It holds one host
        copy of the state from now on, as a checkpointer does after its first
        save. Raises ``AsyncCheckpointError`` while a save is in flight (its
        buffers are busy) or once closed.

        Example::

            ckpt = AsyncCheckpointer(path, rank, world_size, spec)
            ckpt.prepare(model.state_dict(), background=True)   # returns at once
            for step in range(steps):
                train_step()
                if step % 1000 == 0:
                    ckpt.save_async(model.state_dict(), dir=f"{path}/step-{step}")
        """
        with self._lock:  # held while staging: a concurrent save_async must not take the buffers
            self._check_idle(self.dir)
            try:
                if background:
                    buffers, unfaulted = self._take_buffers()
                    try:
                        self._reserve = StagingReserve(state_dict, buffers, unfaulted)
                    except BaseException:
                        self._buffers = buffers  # kept for the next save, which makes the rest itself
                        raise
                else:
                    self._stage_checked(state_dict)
            except BaseException as e:
                raise AsyncCheckpointError(f"preparing the staging buffers failed: {type(e).__name__}: {e}") from e

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, if any (see :meth:`CheckpointFuture.wait`)."""
        future = self._in_flight
        if future is not None:
            future.wait(timeout)

    def close(self) -> None:
        """Wait for the save in flight, free the staging buffers (and a split shardkit Group).

        Raises the last save's failure unless a ``wait()`` already raised it.
        Idempotent. A closed checkpointer refuses ``save_async``. Interrupted
        (Ctrl-C) while the save runs, it tears nothing down: the save goes on,
        and ``close()`` may be called again.
        """
        if self._closed:
            return
        future = self._in_flight
        if future is not None:
            future.wait_finished()  # first: nothing the save uses is freed while it runs
        with self._lock:  # after a prepare() on another thread, never beside it
            self._closed = True
            reserve, self._reserve, self._buffers = self._reserve, None, {}
        if reserve is not None:
            reserve.take()  # stops its thread; its buffers go with it
        self._destroy_own_group()
        if future is not None and not future.reported:
            future.wait()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: finish the save, but do not hide the first error.
        try:
            self.close()
        except AsyncCheckpointError:
            pass

    # --- internals -----------------------------------------------------------

    def _check_idle(self, target: str) -> None:
        if self._closed:
            raise AsyncCheckpointError("this AsyncCheckpointer is closed; create a new one to save again")
        running = self._in_flight
        if running is not None and not running.done():
            raise AsyncCheckpointError(
                f"a checkpoint save to {running.dir} is still in flight; only one save runs at a "
                f"time. Call wait() on its future (or on the checkpointer) before save_async() "
                f"to {target}"
            )

    def _check_overwrite(self, target: str, overwrite: bool) -> None:
        # The background save checks again (under its lock); this makes the common
        # mistake fail here, on the caller's thread, before anything is staged.
        if self.group is None and not overwrite:
            check_may_overwrite(target, self.rank, self.world_size)

    def _claim(self, target: str, mode: WriteMode) -> CheckpointFuture:
        with self._lock:
            self._check_idle(target)
            future = CheckpointFuture(target, f"background checkpoint save (rank {self.rank})", hurry=mode.hurry)
            self._in_flight = future
            return future

    def _take_buffers(self) -> tuple[dict, set[int]]:
        """The buffers for the next staging, and the ids of those not yet faulted in: a background
        ``prepare``'s (stopped now), else the kept ones."""
        reserve, self._reserve = self._reserve, None
        kept, self._buffers = self._buffers, {}  # never two copies held: the caller keeps what it uses
        if reserve is not None:
            return reserve.take()
        return (kept if self.reuse_buffers else {}), set()

    def _stage_checked(self, state_dict):
        buffers, unfaulted = self._take_buffers()
        staged, buffers = stage(state_dict, buffers, unfaulted=unfaulted)
        # Refuse what the save would refuse (non-str keys, leaves that need pickle) here and
        # now, not in the background; cheap: a walk over the leaves.
        flatten(staged)
        self._buffers = buffers if self.reuse_buffers else {}
        return staged

    def _release(self, future: CheckpointFuture) -> None:
        with self._lock:
            if self._in_flight is future:
                self._in_flight = None

    def _start(self, future: CheckpointFuture, target: str, work) -> None:
        """Run ``work`` on the one background engine (``api.start_background_work``: a non-daemon
        thread, after any save started before on this checkpointer's group); its outcome goes to
        ``future``. Once ``future`` is done, the staging buffers may be reused."""
        try:
            start_background_work(work, target, self.group, self.rank, future=future)
        except BaseException:
            self._release(future)
            raise

    def _staging_failed(self, future: CheckpointFuture, target: str, error: BaseException) -> None:
        # With a group, the background save only tells the other ranks (their saves fail at the first
        # exchange instead of waiting for this rank); save_async raises the error itself.
        if self.group is not None and isinstance(error, Exception):
            future.mark_reported()
            self._start(future, target, lambda: report_failed_save(target, self.rank, self.world_size, self.group,
                                                                   error))
        else:
            self._release(future)

    def _destroy_own_group(self) -> None:
        group, self._own_group = self._own_group, None
        # A torch group is left alive on purpose: torch names a group made with
        # use_local_synchronization after its ranks and the number of live groups, so
        # destroying it would give the next checkpointer's group the same name and
        # store keys, and its ranks would rendezvous with stale keys and hang.
        # It is freed with the default process group.
        if group is not None and hasattr(group, "close"):
            group.close()  # a shardkit Group split: its own store prefix, safe to close

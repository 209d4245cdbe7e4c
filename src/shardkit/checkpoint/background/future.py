"""``CheckpointFuture``: the outcome of one background save, shared by every way of starting one.

:class:`~shardkit.checkpoint.background.checkpointer.AsyncCheckpointer`, the functional
``async_save`` and ``CheckpointManager`` hand one out per save; the thread
that writes calls :meth:`CheckpointFuture.finish` once, last. It runs nothing itself.

Example::

    future = ckpt.save_async(state)
    ...
    future.wait()   # raises AsyncCheckpointError if the save failed
"""

from __future__ import annotations

import threading
import time

from shardkit.errors import AsyncCheckpointError, AsyncCheckpointIOError, AsyncWaitTimeout, CheckpointIOError

__all__ = ["CheckpointFuture"]


class CheckpointFuture:
    """The outcome of one background save: ``wait()`` for it, ``done()`` to poll.

    ``wait()`` may be called any number of times, from any thread; after a
    failure every call raises a new :class:`~shardkit.errors.AsyncCheckpointError`
    chained to the same cause. It does not cancel the save. A wait that blocks
    (any ``timeout`` but 0) first lifts the save's pace (``knobs.BACKGROUND_DISK_SHARE``):
    whoever waits is not training, so the rest is written at full speed.

    Example::

        future = ckpt.save_async(state)
        ...
        if future.done():
            future.wait()   # returns at once, or raises the failure
    """

    def __init__(self, dir: str, description: str = "checkpoint save", *, hurry=None):
        self.dir = dir
        self._hurry = hurry  # lifts the save's pace (a WriteMode's hurry), or None
        self._description = description
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._started_s = time.monotonic()
        self._finished_s: float | None = None
        self._reported = False  # a failure already raised by wait(); close() does not repeat it

    def done(self) -> bool:
        """True once the background save has finished, successfully or not."""
        return self._finished.is_set()

    def wait_finished(self, timeout: float | None = None, *, hurry: bool = True) -> bool:
        """Block until the save has finished, successfully or not, without raising its failure.

        False when ``timeout`` (seconds) ran out first. Safe to interrupt (a
        KeyboardInterrupt leaves the future as it was), unlike joining the
        save's thread on Python 3.11, which can then call a running thread stopped.
        A blocking wait lifts the save's pace first (:meth:`hurry`) unless ``hurry=False``.
        """
        if hurry and (timeout is None or timeout > 0):
            self.hurry()
        return self._finished.wait(timeout)

    def wait(self, timeout: float | None = None, *, hurry: bool = True) -> None:
        """Block until the save finished; raise ``AsyncCheckpointError`` if it failed.

        ``timeout`` (seconds): give up waiting after that long and raise
        :class:`AsyncWaitTimeout` (a ``TimeoutError``); the save goes on. ``timeout=0`` polls; any
        other wait lifts the save's pace first (:meth:`hurry`), unless ``hurry=False`` (a thread that
        only watches for the end while training goes on elsewhere).
        """
        if not self.wait_finished(timeout, hurry=hurry):
            raise AsyncWaitTimeout(
                f"the {self._description} to {self.dir} is still running after waiting "
                f"{timeout} s (started {time.monotonic() - self._started_s:.1f} s ago); "
                f"the future is still valid: call wait() again, with a longer or no timeout"
            )
        if self._error is not None:
            self._reported = True
            message = (f"the {self._description} to {self.dir} failed: "
                       f"{type(self._error).__name__}: {self._error}. The checkpoint there is "
                       f"incomplete and will not load; checkpoints in other directories are untouched. "
                       f"The checkpointer accepts a new save_async().")
            e = self._error
            if isinstance(e, CheckpointIOError):  # still an OSError with its errno
                raise AsyncCheckpointIOError(message, e.errno, e.strerror, e.filename) from e
            raise AsyncCheckpointError(message) from e

    def hurry(self) -> None:
        """Write the rest of the save at full speed, not at ``knobs.BACKGROUND_DISK_SHARE`` of it (for a
        caller about to block on it, or done training). Does nothing once the save is done."""
        if self._hurry is not None and not self.done():
            self._hurry()

    @property
    def duration_s(self) -> float | None:
        """Seconds from ``save_async`` to the end of the write, once done."""
        return None if self._finished_s is None else self._finished_s - self._started_s

    @property
    def description(self) -> str:
        """What the save is, for messages (``"checkpoint save"``)."""
        return self._description

    @property
    def error(self) -> BaseException | None:
        """The failure of a finished save (None while it runs, and after a success); raises nothing."""
        return self._error

    @property
    def reported(self) -> bool:
        """Whether the failure has reached someone (raised by :meth:`wait`, or marked), so nothing repeats it."""
        return self._reported

    def mark_reported(self) -> None:
        """Say that the failure is raised or logged elsewhere: ``close()`` and the exit report stay quiet."""
        self._reported = True

    def finish(self, error: BaseException | None = None) -> None:
        """End the save (``error``: why it failed); called once, last, by the thread that writes."""
        self._error = error
        self._finished_s = time.monotonic()
        self._finished.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"CheckpointFuture(dir={self.dir!r}, {state})"

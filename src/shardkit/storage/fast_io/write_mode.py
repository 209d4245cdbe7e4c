"""How a durable write treats the machine it shares with training: past the page cache or through
it, and at what pace.

A background save that writes at the disk's full speed costs a training loop
on the same machine CPU time per byte (the kernel's and the hypervisor's I/O
work, the memory bus), all of it while the save runs: on the 2-core VM,
300 MiB written in the background at full speed slowed a tiny Llama's steps
by +15-36% (eleven runs), and another process writing the same bytes with ``O_DIRECT`` as
fast by +20%. The cost follows the rate: paced to a quarter of the disk's
speed the same save slowed them by -2% to +23% (the medians of seven runs,
five of them +3% to +11%), to a tenth by -7% to +14% (eight bench runs of
5-8 saves) and +0.9% pooled over 60 saves of three A/B runs, around the
machine's own noise (another process writing, the floor, -5% to +5% in the
same bench runs; nothing in flight at all, -8% to +3%);
the training time lost per save stayed about the same. So background saves
(``WriteMode.background()``) are paced, at ``knobs.BACKGROUND_DISK_SHARE``
(a tenth by default), and blocking ones (:data:`FOREGROUND`) are not.

The pacing itself is the C writer's for local files (``_direct_writer.c``)
and the upload's for S3 parts (``backends.s3_upload``, through
:meth:`Pace.rest_after`); this module holds what the save layers pass down
to them. Not here: opening or writing files (``direct_io``, ``sinks``).

Example::

    mode = WriteMode.background()      # knobs.BACKGROUND_DIRECT_IO, BACKGROUND_DISK_SHARE
    write_safetensors(storage, path, named, mode=mode)   # on a background thread
    mode.hurry()                       # from the thread that now waits for it: full speed
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from shardkit import knobs

__all__ = ["Pace", "WriteMode", "FOREGROUND", "PACED_SHARE_OF_DEADLINE"]

#: A save whose ranks meet in a collective after writing stays paced for at most this share of that
#: collective's timeout (``WriteMode.paced_for_at_most``), then writes the rest at full speed: a rank
#: with far more to write than the others (rank 0 of an uneven state, a slow disk) must not keep
#: them waiting in the exchange until the group's deadline fails the save.
PACED_SHARE_OF_DEADLINE = 0.25


class Pace:
    """The share of the disk's speed one background save's writers use, until :meth:`hurry` lifts it.

    ``share`` in (0, 1]: below 1 a direct sink writes one buffer at a time and
    rests after each for ``(1 - share) / share`` times as long as the write
    took, so it runs at that share of the disk's speed, whatever the disk
    (``_direct_writer.c``). Every sink the save opens joins the pace;
    :meth:`hurry` (called when someone blocks on the save: nobody is training
    then) ends the rests of the sinks writing now and of those opened later.
    Object-store uploads rest the same way between parts (:meth:`rest_after`).
    What it does not do: pace small files written inline, or buffered fallbacks.

    Example::

        pace = Pace(0.25)
        open_direct_sink(fd, hasher, mode=WriteMode(pace=pace))   # a quarter of the disk's speed
        pace.hurry()                                               # full speed from now on
    """

    def __init__(self, share: float):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a background save's disk share must be in (0, 1], got {share!r} "
                             f"(knobs.BACKGROUND_DISK_SHARE); 1 writes at full speed, 0.25 at a quarter of it")
        self._share = self.asked_share = float(share)   # asked_share: what the save was given
        self._lock = threading.Lock()
        self._engines: set = set()
        self._hurried = threading.Event()

    @property
    def share(self) -> float:
        """The share now: ``asked_share`` until :meth:`hurry`, then 1."""
        return self._share

    def join(self, engine) -> float:
        """The share a new writer ``engine`` (a ``DirectWriter``) starts at; :meth:`hurry` reaches it
        until :meth:`leave`."""
        with self._lock:
            if self._share < 1.0:
                self._engines.add(engine)
            return self._share

    def leave(self, engine) -> None:
        with self._lock:
            self._engines.discard(engine)

    def hurry(self) -> None:
        """Full speed from now on, for the writers writing now and any opened later. Idempotent."""
        with self._lock:
            self._share, engines = 1.0, list(self._engines)
            self._engines.clear()
            self._hurried.set()
        for engine in engines:
            engine.hurry()

    def rest_after(self, took_s: float) -> None:
        """Rest ``(1 - share) / share`` times ``took_s`` (what one piece of work took); :meth:`hurry` cuts
        it short. For writers paced in Python (object-store parts); the C writer rests on its own."""
        share = self._share
        if share < 1.0:
            self._hurried.wait(took_s * (1.0 - share) / share)


@dataclass(frozen=True)
class WriteMode:
    """How a durable local write treats the machine it shares with training.

    ``o_direct``: write past the page cache (False: the same C writer through
    it). ``pace``: a :class:`Pace` shared by the files of one background save
    (None: full speed). :data:`FOREGROUND` is ``save``'s; :meth:`background`
    makes a background save's, from the knobs.

    Example::

        mode = WriteMode.background()      # knobs.BACKGROUND_DIRECT_IO, BACKGROUND_DISK_SHARE
        ...                                # the save's files written with it
        mode.hurry()                       # the caller now waits for the save: full speed
    """

    o_direct: bool = True
    pace: Pace | None = None

    @classmethod
    def background(cls) -> "WriteMode":
        """A background save's mode, from ``knobs.BACKGROUND_DIRECT_IO`` and ``knobs.BACKGROUND_DISK_SHARE``
        (read now; ``ValueError`` for a share outside (0, 1])."""
        return cls(o_direct=knobs.BACKGROUND_DIRECT_IO, pace=Pace(knobs.BACKGROUND_DISK_SHARE))

    def hurry(self) -> None:
        """Lift the pace, if any (:meth:`Pace.hurry`)."""
        if self.pace is not None:
            self.pace.hurry()

    @contextlib.contextmanager
    def paced_for_at_most(self, seconds: float | None):
        """Within the block, lift the pace ``seconds`` after it began (None, or no pace: nothing to do).

        The write of a multi-rank save runs inside it with ``PACED_SHARE_OF_DEADLINE`` of its group's
        timeout (``saving.chunked_save.write_and_commit``)::

            with mode.paced_for_at_most(600 * PACED_SHARE_OF_DEADLINE):
                ...                        # paced for 150 s at most, then full speed
        """
        if self.pace is None or seconds is None:
            yield
            return
        timer = threading.Timer(min(max(0.0, seconds), threading.TIMEOUT_MAX), self.pace.hurry)  # a huge timeout too
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


#: Blocking saves: ``O_DIRECT``, unpaced.
FOREGROUND = WriteMode()

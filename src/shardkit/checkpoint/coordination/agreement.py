"""One step of a group save: every rank reports to rank 0, rank 0 decides, every rank hears the verdict.

A save is a few such steps (``distributed_save``, ``chunked_save``). In each,
every rank runs its part with :func:`attempt` (an exception is caught, not
raised, so it can reach the other ranks), then calls :func:`agree` with a
status (``{"error": describe(exc), ...}``). Rank 0 gathers the statuses
(``group.settle``: one gather, one broadcast); if every rank succeeded it
runs ``on_root(statuses)`` (e.g. writes ``metadata.json``) and broadcasts
its JSON result, otherwise it broadcasts the first failure. Then every rank
raises together: its own exception if it had one, rank 0's ``on_root``
exception on rank 0, else a ``CheckpointBusyError`` / ``CheckpointError``
naming the first rank that failed. No rank is left blocked and none goes on
alone. This module does not choose what a step does, nor touch storage.

Example::

    records, exc = attempt(lambda: write_my_file())
    agree(coordinator, {"error": describe(exc), "files": records}, exc, "writing the data files",
          on_root=commit, root_step="writing metadata.json")
"""

from __future__ import annotations

from typing import Any, Callable

from shardkit.checkpoint.coordination.group import SLOT_BYTES, settle
from shardkit.errors import CheckpointBusyError, CheckpointError

__all__ = ["FIRST_STEP", "agree", "attempt", "describe"]

#: The step before anything is touched: a failure there leaves nothing written.
FIRST_STEP = "preparing and locking the save"


def attempt(fn):
    """``(result, None)`` or ``(None, exception)``: a rank's failure must reach the others, not hang them."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        return None, e


def describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def agree(coordinator, status: dict, own: BaseException | None, step: str, *,
          on_root: Callable[[list[dict]], Any] | None = None, root_step: str | None = None,
          slot_bytes: int = SLOT_BYTES) -> Any:
    """Settle one step; return ``on_root``'s result (None without it) on every rank, or raise on every rank.

    ``status`` must hold ``"error"`` (``describe(own)``). ``on_root`` runs on
    rank 0 only, only when no rank failed, with every rank's status in rank
    order; a failure there is reported as rank 0's, in ``root_step`` (default
    ``step``). ``coordinator`` None (one process): the same, on this rank alone.
    """
    raised: list[BaseException] = []

    def decide(statuses: list[dict]) -> dict:
        failed = [(r, s["error"]) for r, s in enumerate(statuses) if s.get("error")]
        if failed:
            return {"rank": failed[0][0], "error": failed[0][1], "step": step}
        if on_root is None:
            return {"value": None}
        value, exc = attempt(lambda: on_root(statuses))
        if exc is not None:
            raised.append(exc)
            return {"rank": 0, "error": describe(exc), "step": root_step or step}
        return {"value": value}

    verdict = decide([status]) if coordinator is None else settle(coordinator, status, decide, step,
                                                                     slot_bytes=slot_bytes)
    if own is not None:
        raise own
    if raised:
        raise raised[0]
    if "error" in verdict:
        _raise_failure(verdict["rank"], verdict["error"], verdict["step"])
    return verdict["value"]


def _raise_failure(rank: int, message: str, step: str) -> None:
    kind = CheckpointBusyError if message.startswith(f"{CheckpointBusyError.__name__}:") else CheckpointError
    outcome = "nothing was written" if step == FIRST_STEP else "this checkpoint is incomplete (metadata.json was not written)"
    raise kind(f"the save failed on rank {rank} while {step}: {message}; {outcome}")

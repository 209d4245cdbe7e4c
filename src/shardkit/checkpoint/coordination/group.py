"""The process group a save runs over, and pickle-free collectives of small JSON facts.

``group`` may be None (no coordination: the seed's behaviour), a torch
``ProcessGroup``, or any object with a ``.process_group`` attribute
(shardkit's ``comm.Group``; one whose ``process_group`` is None is a group of
one and needs no coordination). Values travel as ``uint8`` tensors of JSON
text (device tensors on an NCCL group): nothing is pickled.

- :func:`settle` is one round of a save: every rank's value goes to rank 0
  (a gather), rank 0 decides, and every rank gets rank 0's verdict (a
  broadcast). Each is ``world_size - 1`` messages, so a round costs O(ranks)
  messages where an all-gather costs O(ranks^2) (a ring hands every value to
  every rank). Values fit a fixed slot (``slot_bytes``); a longer one costs
  one more broadcast and gather in that round, a longer verdict one more broadcast.
- :func:`broadcast_json` is rank 0's value on every rank (one broadcast).
- :func:`exchange` all-gathers every rank's value to every rank (two
  all-gathers); the save uses it only where every rank needs every value
  (the fallback exchange of boxes when the compact layouts differ).

A failed collective raises a ``CommError`` naming the step, so a failure on
one rank fails the save on every rank instead of leaving them blocked.

Example::

    coordinator = resolve_group(group, rank, world_size)
    verdict = settle(coordinator, {"error": None}, lambda statuses: {"ok": True}, "writing the data files")
    statuses = exchange(coordinator, {"ok": True}, "writing the data files")   # one dict per rank
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardkit.comm import Group
from shardkit.comm.process_group_view import ProcessGroupView
from shardkit.errors import CheckpointError, CommError, MetadataError

__all__ = ["resolve_group", "settle", "broadcast_json", "rank0_decides", "exchange", "EXCHANGE_OBSERVERS",
           "SLOT_BYTES", "BROADCAST_SLOT_BYTES"]

#: Called after every :func:`settle`, :func:`broadcast_json` and :func:`exchange` as
#: ``f(rank, collectives, received_bytes, sent_bytes)``: the collectives this rank issued, the
#: bytes it received from the other ranks (its result, less its own part) and the bytes of its
#: own input (what a backend forwards along a ring or tree is not counted). Empty unless a test
#: or ``bench/checkpoint_suites/scale_bench.py`` counts a save's traffic (append, then remove, a callable).
EXCHANGE_OBSERVERS: list = []

#: The default slot a rank's value takes in a :func:`settle` gather, its 8-byte length included.
#: Part of the protocol, not a tunable: every rank must use the same (a longer value still goes
#: through, in one more gather).
SLOT_BYTES = 256
#: The slot of rank 0's verdict in a broadcast (a longer one takes a second broadcast).
BROADCAST_SLOT_BYTES = 128
_LENGTH_BYTES = 8


def resolve_group(group: Any, rank: int, world_size: int):
    """What coordinates a save: None (no group, or a group of one), a shardkit
    ``comm.Group`` as it is (its timeouts and abort apply), or a torch
    ``ProcessGroup`` (or another object's ``.process_group``) wrapped in
    ``comm.ProcessGroupView``; checked against ``rank`` and ``world_size``.
    """
    if group is None:
        return None
    pg = getattr(group, "process_group", group)
    if pg is None:
        return None                      # a group of one: nothing to coordinate
    if isinstance(group, Group):
        coordinator = group
    elif isinstance(pg, dist.ProcessGroup):
        coordinator = ProcessGroupView(pg)
    else:
        raise TypeError(f"group must be None, a torch ProcessGroup, a shardkit comm.Group or an object "
                        f"with a .process_group, got {type(group).__name__}")
    if (coordinator.rank, coordinator.world_size) != (rank, world_size):
        raise MetadataError(
            f"save called with rank {rank} of world_size {world_size}, but this process is rank "
            f"{coordinator.rank} of {coordinator.world_size} in the group; pass the group's own rank and size"
        )
    return coordinator


def settle(group, value: Any, decide: Callable[[list[Any]], Any], step: str = "a step of the save", *,
           slot_bytes: int = SLOT_BYTES) -> Any:
    """Rank 0's ``decide(values)`` (every rank's ``value`` in rank order), returned on every rank.

    A collective: all ranks call it with the same ``slot_bytes``; ``decide``
    runs on rank 0 only and must return a JSON-serialisable verdict (it should
    not raise: an exception there still reaches every rank, as a
    ``CheckpointError`` naming ``step``). Only rank 0 sees the values; use
    :func:`exchange` where every rank needs every value. A failed collective
    raises ``CommError`` as :func:`exchange` does.

    >>> settle(g, {"error": None}, lambda vs: not any(v["error"] for v in vs), "withdrawing")   # True
    """
    try:
        counts = _Counts()
        verdict = _settle(group, value, decide, slot_bytes, counts)
        counts.report(group.rank)
    except CommError as e:
        raise _lost_peer(e, group, step) from e
    if "abandoned" in verdict:
        raise CheckpointError(f"the save failed on rank 0 while {step}: {verdict['abandoned']}; this checkpoint is "
                              f"incomplete (metadata.json was not written)")
    return verdict["verdict"]


def broadcast_json(group, value: Any, step: str = "a step of the save") -> Any:
    """Rank 0's ``value`` (JSON-serialisable; ignored on the other ranks), on every rank. A collective."""
    try:
        counts = _Counts()
        out = _broadcast(group, value, counts)
        counts.report(group.rank)
        return out
    except CommError as e:
        raise _lost_peer(e, group, step) from e


def rank0_decides(group, rank: int, decide: Callable[[], Any], what: str) -> Any:
    """``decide()`` run on rank 0 alone, its (JSON) result on every rank; ``group`` None: one process.

    A failure there is raised on every rank: on rank 0 as it is, on the
    others as a :class:`CheckpointError` naming it (none of them waits for a
    broadcast that never comes). Example::

        step = rank0_decides(group, rank, manager.latest_step, "choosing the step to restore")
    """
    if group is None:
        return decide()
    outcome, failure = None, None
    if rank == 0:
        try:
            outcome = ["ok", decide()]
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            outcome, failure = ["failed", f"{type(e).__name__}: {e}"], e
    outcome = broadcast_json(group, outcome, what)
    if failure is not None:
        raise failure
    if outcome[0] == "failed":
        raise CheckpointError(f"rank 0 failed while {what}: {outcome[1]}")
    return outcome[1]


def exchange(group, value: Any, step: str = "a step of the save") -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. A collective: all ranks call it.

    A failed collective (a peer died or hangs) raises the same ``CommError``
    subclass, its message naming ``step`` and saying what it means for the checkpoint.
    """
    try:
        return _exchange(group, value)
    except CommError as e:
        raise _lost_peer(e, group, step) from e


def _lost_peer(e: CommError, group, step: str) -> CommError:
    return type(e)(
        f"the save could not go on while {step}: rank {group.rank} of {group.world_size} did not hear "
        f"from every other rank ({e}). A peer rank has probably died or stopped; this checkpoint is "
        f"incomplete (metadata.json was not written) and checkpoints in other directories are "
        f"untouched. Restart the job and resume from the latest complete checkpoint")


class _Counts:
    """What one call moved, for ``EXCHANGE_OBSERVERS``."""

    def __init__(self):
        self.collectives = self.received = self.sent = 0

    def add(self, received: int, sent: int) -> None:
        self.collectives, self.received, self.sent = self.collectives + 1, self.received + received, self.sent + sent

    def report(self, rank: int) -> None:
        for observe in list(EXCHANGE_OBSERVERS):
            observe(rank, self.collectives, self.received, self.sent)


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _decode(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"))


def _padded(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _frame(payload: bytes, slot_bytes: int, device) -> torch.Tensor:
    """``[length as int64][the payload's first slot_bytes - 8 bytes, zero-padded]``."""
    length = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([length, _padded(payload[: slot_bytes - _LENGTH_BYTES], slot_bytes - _LENGTH_BYTES)]).to(device)


def _unframe(frame: torch.Tensor) -> tuple[int, bytes]:
    data = bytes(frame.cpu().numpy())
    length = int(torch.frombuffer(bytearray(data[:_LENGTH_BYTES]), dtype=torch.int64).item())
    return length, data[_LENGTH_BYTES: _LENGTH_BYTES + length]


def _settle(group, value: Any, decide, slot_bytes: int, counts: _Counts) -> dict:
    if slot_bytes <= _LENGTH_BYTES:
        raise ValueError(f"slot_bytes must exceed the {_LENGTH_BYTES}-byte length, got {slot_bytes}")
    root, device, others = group.rank == 0, _device(group), group.world_size - 1
    payload = _encode(value)
    frames = group.gather(_frame(payload, slot_bytes, device), 0)
    counts.add(others * slot_bytes if root else 0, 0 if root else slot_bytes)
    heads = [_unframe(f) for f in frames] if root else []
    room = slot_bytes - _LENGTH_BYTES
    tail = max(n for n, _ in heads) - room if root else 0
    if tail > 0:                     # some value did not fit its slot: every rank sends the rest
        _broadcast(group, {"tail": tail}, counts)
    if not root:
        message = _broadcast(group, None, counts)
        if "tail" not in message:
            return message
        tail = message["tail"]
    if tail > 0:
        rests = group.gather(_padded(payload[room:], tail).to(device), 0)
        counts.add(others * tail if root else 0, 0 if root else tail)
        if not root:
            return _broadcast(group, None, counts)
        heads = [(n, head + bytes(r.cpu().numpy())[: max(0, n - room)]) for (n, head), r in zip(heads, rests)]
    try:
        verdict = {"verdict": decide([_decode(data) for _, data in heads])}
    except Exception as e:  # noqa: BLE001 - reaches every rank, then re-raised here
        _broadcast(group, {"abandoned": f"{type(e).__name__}: {e}"}, counts)
        raise
    return _broadcast(group, verdict, counts)


def _broadcast(group, value: Any, counts: _Counts) -> Any:
    """Rank 0's ``value`` on every rank: one broadcast of a slot, a second one for what did not fit."""
    root, device, size = group.rank == 0, _device(group), BROADCAST_SLOT_BYTES
    payload = _encode(value) if root else b""
    received = group.broadcast(_frame(payload, size, device), 0)
    counts.add(0 if root else size, size if root else 0)
    length, head = _unframe(received)
    rest = length - (size - _LENGTH_BYTES)
    if rest > 0:
        tail = group.broadcast(_padded(payload[size - _LENGTH_BYTES:], rest).to(device), 0)
        counts.add(0 if root else rest, rest if root else 0)
        head += bytes(tail.cpu().numpy())
    return value if root else _decode(head)


def _exchange(group, value: Any) -> list[Any]:
    device = _device(group)
    payload = _encode(value)
    lengths = group.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device))
    longest = max(int(n.item()) for n in lengths)
    gathered = group.all_gather(_padded(payload, longest).to(device))
    counts = _Counts()
    counts.add((group.world_size - 1) * _LENGTH_BYTES, _LENGTH_BYTES)
    counts.add((group.world_size - 1) * longest, longest)
    counts.report(group.rank)
    return [_decode(bytes(t[: int(n.item())].cpu().numpy())) for t, n in zip(gathered, lengths)]

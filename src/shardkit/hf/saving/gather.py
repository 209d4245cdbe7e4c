"""Assemble whole tensors on the ranks that write them, from the boxes other ranks hold, round by round.

A job's Hugging Face save gives each whole tensor one writer rank
(``export_plan``). Here each writer gets the boxes it lacks, point to point,
from one holder each (a box that several ranks hold, as replicas do, is
sent once): never the whole model on one rank, never a whole tensor on
every rank (``DTensor.full_tensor`` would put each tensor on every rank).
Round ``k`` assembles every rank's ``k``-th tensor at once, so all ranks
send and receive together; senders cast to the exported dtype first (a
bf16 export moves half the bytes of fp32). The planning half
(:func:`rounds_of`, :func:`box_senders`) is pure; :func:`run_rounds` moves
the bytes with ``torch.distributed`` ``isend`` / ``irecv`` and hands each
assembled tensor to the writer through a :class:`Handoff` of depth one.
Not here: which rank writes what, files.

Example::

    rounds = rounds_of([["a", "b"], ["c"]])         # [{0: "a", 1: "c"}, {0: "b"}]
    box_senders([Box((0,), (2,)), Box((2,), (2,))], writer=0)   # [(1, Box((2,), (2,)))]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.errors import TensorMismatchError
from shardkit.layout import Box

__all__ = ["GatherTensor", "rounds_of", "box_senders", "run_rounds", "Handoff"]


@dataclass(frozen=True)
class GatherTensor:
    """One tensor to assemble: global shape, exported dtype, every rank's box, this rank's local tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]          # one per rank of the group, empty where a rank holds nothing
    local: torch.Tensor             # this rank's part (a plain tensor: the whole of it)


def rounds_of(sequences: Sequence[Sequence[str]]) -> list[dict[int, str]]:
    """Round ``k``: ``{rank: its k-th name}`` for every rank with a ``k``-th name. Pure.

    >>> rounds_of([["a", "b"], ["c"]])
    [{0: 'a', 1: 'c'}, {0: 'b'}]
    """
    count = max((len(s) for s in sequences), default=0)
    return [{r: s[k] for r, s in enumerate(sequences) if k < len(s)} for k in range(count)]


def box_senders(boxes: Sequence[Box], writer: int) -> list[tuple[int, Box]]:
    """``(sender rank, box)`` for each distinct non-empty box ``writer`` lacks, in first-held order. Pure.

    A box held by several ranks is sent by one of them, chosen by the writer
    (``holders[writer % len(holders)]``) so replicas share the sending.

    >>> box_senders([Box((0,), (2,)), Box((2,), (2,)), Box((2,), (2,))], writer=0)
    [(1, Box(offsets=(2,), sizes=(2,)))]
    """
    holders: dict[Box, list[int]] = {}
    for rank, box in enumerate(boxes):
        if box.numel:
            holders.setdefault(box, []).append(rank)
    own = boxes[writer]
    return [(ranks[writer % len(ranks)], box) for box, ranks in holders.items() if box != own]


class Handoff:
    """Tensors passed from the assembling thread to the writing one, one at a time, in order.

    ``put`` waits while the previous one is not taken; ``take(name)`` waits
    for the next one and checks it is ``name``. ``close`` (the writer is done
    or failed) makes later ``put`` calls drop their tensor, so the rounds
    still finish for the other ranks; ``fail`` (the rounds failed) makes
    ``take`` raise instead of waiting forever.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._item: Optional[tuple[str, torch.Tensor]] = None
        self._closed = False
        self._error: Optional[BaseException] = None

    def put(self, name: str, tensor: torch.Tensor) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._item is None or self._closed)
            if not self._closed:
                self._item = (name, tensor)
                self._cv.notify_all()

    def take(self, name: str) -> torch.Tensor:
        with self._cv:
            self._cv.wait_for(lambda: self._item is not None or self._error is not None)
            if self._item is None:
                raise TensorMismatchError(f"the tensors for this rank's files could not be gathered: "
                                          f"{self._error}") from self._error
            got, tensor = self._item
            self._item = None
            self._cv.notify_all()
        if got != name:  # a bug, not bad input: the writer and the rounds disagree on the order
            raise TensorMismatchError(f"the writer asked for {name!r} but the rounds produced {got!r}")
        return tensor

    def close(self) -> None:
        with self._cv:
            self._closed, self._item = True, None
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()


def run_rounds(rounds: Sequence[dict[int, str]], tensors: dict[str, GatherTensor], rank: int, pg,
               deliver: Callable[[str, torch.Tensor], None]) -> None:
    """Assemble this rank's tensor of each round and ``deliver(name, tensor)`` it; send what others lack.

    Every rank of ``pg`` (a torch ``ProcessGroup``; None: one process, no
    messages) must call it with the same rounds. Memory: the tensor being
    assembled, plus this rank's own parts of the round's other tensors, cast
    for sending; what ``deliver`` keeps is the caller's.
    """
    device = _comm_device(pg)
    for round_ in rounds:
        works, keep, copies, target = [], [], [], None
        for writer, name in round_.items():
            t = tensors[name]
            if writer == rank:
                missing = box_senders(t.boxes, writer)
                if not missing and t.local.dtype == t.dtype:  # it holds the whole tensor as written: no copy
                    target = t.local.detach()
                    continue
                target = torch.empty(t.shape, dtype=t.dtype, device=device)
                _own_part(t, rank, target)
                works += [_receive(target, box, sender, pg, copies) for sender, box in missing]
            elif any(sender == rank for sender, _ in box_senders(t.boxes, writer)):
                buf = t.local.detach().to(device=device, dtype=t.dtype).contiguous()
                keep.append(buf)
                works.append(dist.isend(_bytes(buf), dst=dist.get_global_rank(pg, writer), group=pg))
        for work in works:
            work.wait()
        for view, received in copies:
            view.copy_(received)
        if target is not None:
            deliver(round_[rank], target)


def _own_part(t: GatherTensor, rank: int, target: torch.Tensor) -> None:
    box = t.boxes[rank]
    if box.numel:
        _view(target, box).copy_(t.local.detach())


def _receive(target: torch.Tensor, box: Box, sender: int, pg, copies: list):
    """Post the receive of ``box`` into ``target`` (straight in when that box is contiguous there)."""
    view = _view(target, box)
    buf = view if view.is_contiguous() else torch.empty(tuple(box.sizes), dtype=target.dtype, device=target.device)
    if buf is not view:
        copies.append((view, buf))
    return dist.irecv(_bytes(buf), src=dist.get_global_rank(pg, sender), group=pg)


def _view(target: torch.Tensor, box: Box) -> torch.Tensor:
    return target[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # bytes, not elements: Gloo moves any dtype that way (bf16, float8, bool)
    return t.reshape(-1).view(torch.uint8)


def _comm_device(pg) -> torch.device:
    if pg is not None and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

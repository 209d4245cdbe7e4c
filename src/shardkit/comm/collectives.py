"""The collectives of a :class:`~shardkit.comm.Group`, as a mixin.

Each method validates its arguments, applies the GPU-tensor rule, issues the
torch ``ProcessGroup`` call asynchronously and waits through
:func:`~shardkit.comm.abort.wait_work`, so nothing here can hang past the
group's timeout or an abort. On an NCCL group a CUDA collective is waited
for as torch waits (the current stream, not the host, is ordered after it)
unless ``knobs.COMM_NCCL_BLOCKING_WAIT`` was set when the group was built.
Shapes are not exchanged between ranks (that would cost a second round
trip), so ranks that pass different shapes or
dtypes are not caught here: the backend may raise a ``CommError``, time out,
return wrong values (an ``all_reduce`` or ``broadcast`` whose sizes differ),
or, with Gloo's ``all_gather``, abort the process. Set
``knobs.COMM_CHECK_ARGS = True`` while debugging to get a
``CommArgumentError`` on every rank instead (one small extra collective per call).

Example::

    out = group.all_reduce(torch.ones(3))          # new tensor, input untouched
    group.all_reduce_([w, b], ReduceOp.AVG)        # in place, one coalesced op
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardkit import knobs
from shardkit.comm.buckets import pack, pack_bytes, plan_buckets, unpack, unpack_bytes
from shardkit.comm.gpu_policy import choose_route, host_round_trip, warn_fallback
from shardkit.comm.reduce_op import ReduceOp, coerce_op, finish, plan_reduction, to_wire
from shardkit.errors import CommArgumentError, InvalidRankError

__all__ = ["Collectives"]


def _tensor_list(tensors, what: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    tensors = list(tensors)
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise CommArgumentError(f"{what} takes tensors, got {bad[:3]}; pass a list of torch.Tensor")
    return tensors


def _one_tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CommArgumentError(f"{what} takes one torch.Tensor, got {type(tensor).__name__}")
    return tensor


class Collectives:
    """Collective operations; the host class provides ``_pg``, ``rank``, ``world_size``,
    ``backend``, ``_check_usable(what)``, ``_issue(what, fn, *args)`` (start a work),
    ``_wait(work, what)`` and ``_call(what, fn, *args)`` (both)."""

    # --- routing -----------------------------------------------------------

    def _check_rank(self, r, role: str, what: str) -> int:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world_size:
            raise InvalidRankError(
                f"{what}: {role} {r!r} is not a rank of this group; valid ranks are "
                f"0..{self.world_size - 1} (world_size={self.world_size})"
            )
        return r

    def _route(self, tensors: Sequence[torch.Tensor], what: str) -> str:
        self._check_usable(what)
        return choose_route([t.device for t in tensors], self.backend, what)

    def _check_same_args(self, what: str, tensors, extra="") -> None:
        """With ``knobs.COMM_CHECK_ARGS``: raise on every rank if the ranks' arguments differ."""
        if not knobs.COMM_CHECK_ARGS or self.world_size == 1:
            return
        desc = f"{what} {extra} " + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
        digest = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=7).digest(), "little")
        mine = torch.tensor([digest], dtype=torch.int64)
        everyone = torch.empty(self.world_size, dtype=torch.int64)
        self._call(f"{what} (argument check)", self._pg._allgather_base, everyone, mine)
        differ = [r for r, d in enumerate(everyone.tolist()) if d != everyone[0].item()]
        if differ:
            raise CommArgumentError(
                f"{what}: ranks {differ} passed different tensors (count, shape or dtype) or "
                f"arguments than rank 0; this rank passed {desc[len(what) + 1:][:200]!r}. "
                "Every rank must call the collective with matching tensors."
            )

    def _backend_for(self, t: torch.Tensor) -> str:
        # An NCCL group sends CPU tensors through its Gloo side, with Gloo's rules.
        return "nccl" if self.backend == "nccl" and t.is_cuda else "gloo"

    def _run(self, tensors, what: str, stream, body, written=None) -> None:
        """Run ``body(tensors)`` natively (on ``stream`` for CUDA) or through the host
        (copying back the tensors at indices ``written``, default all)."""
        if not tensors:
            self._check_usable(what)
            return
        if self._route(tensors, what) == "host":
            host_round_trip(tensors, what, body, written)
            return
        ctx = contextlib.nullcontext()
        if stream is not None and tensors[0].is_cuda:
            ctx = torch.cuda.stream(stream)
        with ctx:
            body(tensors)

    # --- reductions --------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` across ranks into a new tensor; the input is left untouched."""
        out = _one_tensor(tensor, "all_reduce").detach().clone(memory_format=torch.contiguous_format)
        self.all_reduce_([out], op)
        return out

    def all_reduce_(self, tensors, op=ReduceOp.SUM, *, stream=None) -> None:
        """Reduce every tensor in place, packed into one collective per dtype/device bucket.

        Every rank must pass the same number of tensors with the same shapes and
        dtypes, in the same order. ``stream`` (CUDA only) is the stream the work
        is ordered on; it is ignored for CPU tensors. See :class:`ReduceOp` for
        integer AVG (floor division) and bool semantics.
        """
        tensors = _tensor_list(tensors, "all_reduce_")
        op = coerce_op(op)
        for dtype, backend in {(t.dtype, self._backend_for(t)) for t in tensors}:
            plan_reduction(op, dtype, backend)  # refuse before any byte moves (cached: cheap)
        self._check_usable("all_reduce_")
        self._check_same_args("all_reduce_", tensors, op.name)
        self._run(tensors, "all_reduce_", stream, lambda ts: self._all_reduce_buckets(ts, op))

    def _all_reduce_buckets(self, tensors, op: ReduceOp) -> None:
        buckets = plan_buckets([t.numel() * t.element_size() for t in tensors],
                               [(t.dtype, t.device) for t in tensors], knobs.COMM_BUCKET_BYTES)
        pending = []
        for idx in buckets:  # issue them all, then wait: buckets overlap on the wire
            group = [tensors[i] for i in idx]
            plan = plan_reduction(op, group[0].dtype, self._backend_for(group[0]))
            flat = pack(group)
            wire = to_wire(flat, plan)
            opts = dist.AllreduceOptions()
            opts.reduceOp = plan.torch_op
            pending.append((self._issue("all_reduce_", self._pg.allreduce, [wire], opts), wire, flat, plan, group))
        for work, wire, flat, plan, group in pending:
            self._wait(work, "all_reduce_", has_future=True)  # allreduce works carry a future
            finish(wire, flat, plan, self.world_size)
            unpack(flat, group)

    def reduce_scatter(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` across ranks and return this rank's slice of dim 0.

        ``tensor.shape[0]`` must be divisible by ``world_size``; rank ``r`` gets
        rows ``[r*k, (r+1)*k)`` of the reduced tensor, ``k = shape[0] // world_size``.
        """
        tensor = _one_tensor(tensor, "reduce_scatter")
        op = coerce_op(op)
        if tensor.dim() == 0 or tensor.shape[0] % self.world_size:
            raise CommArgumentError(
                f"reduce_scatter: dim 0 of the input must be divisible by world_size={self.world_size}; "
                f"got shape {tuple(tensor.shape)}. Pad the tensor to a multiple of the world size."
            )
        plan = plan_reduction(op, tensor.dtype, self._backend_for(tensor))
        self._check_usable("reduce_scatter")
        self._check_same_args("reduce_scatter", [tensor], op.name)
        rows = tensor.shape[0] // self.world_size
        out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self._run([tensor, out], "reduce_scatter", None, lambda ts: self._reduce_scatter(*ts, plan), written=(1,))
        return out

    def _reduce_scatter(self, tensor, out, plan) -> None:
        wire_in = to_wire(tensor.detach().contiguous(), plan)
        wire_out = to_wire(out, plan)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = plan.torch_op
        self._call("reduce_scatter", self._pg._reduce_scatter_base, wire_out, wire_in, opts)
        finish(wire_out, out, plan, self.world_size)

    # --- data movement -----------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Return a new tensor holding rank ``root``'s ``tensor``; the input is left untouched."""
        out = _one_tensor(tensor, "broadcast").detach().clone(memory_format=torch.contiguous_format)
        self.broadcast_([out], root)
        return out

    def broadcast_(self, tensors, root: int, *, stream=None) -> None:
        """Overwrite every tensor with rank ``root``'s, as raw bytes in one collective per device.

        Any dtype works (bytes are copied, not reduced). Every rank passes the
        same count, shapes and dtypes.
        """
        tensors = _tensor_list(tensors, "broadcast_")
        self._check_rank(root, "root", "broadcast_")
        self._check_usable("broadcast_")
        self._check_same_args("broadcast_", tensors, f"root={root}")
        self._run(tensors, "broadcast_", stream, lambda ts: self._broadcast_buckets(ts, root))

    def _broadcast_buckets(self, tensors, root: int) -> None:
        buckets = plan_buckets([t.numel() * t.element_size() for t in tensors],
                               [t.device for t in tensors], knobs.COMM_BUCKET_BYTES)
        pending = []
        for idx in buckets:
            group = [tensors[i] for i in idx]
            flat = pack_bytes(group)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            pending.append((self._issue("broadcast_", self._pg.broadcast, [flat], opts), flat, group))
        for work, flat, group in pending:
            self._wait(work, "broadcast_")
            if self.rank != root:
                unpack_bytes(flat, group)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, ordered by rank; each rank must pass the same shape and dtype."""
        tensor = _one_tensor(tensor, "all_gather")
        src = tensor
        route = self._route([tensor], "all_gather")
        self._check_same_args("all_gather", [tensor])
        if route == "host":
            warn_fallback("all_gather")
            src = tensor.detach().cpu()
        flat_in = src.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        flat_out = torch.empty(flat_in.numel() * self.world_size, dtype=torch.uint8, device=src.device)
        self._call("all_gather", self._pg._allgather_base, flat_out, flat_in)
        parts = [c.view(tensor.dtype).view(tensor.shape) for c in flat_out.chunk(self.world_size)]
        return [p.to(tensor.device) for p in parts] if src is not tensor else parts

    def gather(self, tensor: torch.Tensor, root: int) -> list[torch.Tensor] | None:
        """Rank ``root`` gets every rank's ``tensor``, ordered by rank; the other ranks get None.

        Each rank must pass the same shape and dtype (any dtype: the bytes are
        moved). Every rank sends to
        ``root`` once (``world_size - 1`` messages in all, where ``all_gather``
        moves every tensor to every rank): the pattern for facts only one rank
        needs, such as the statuses rank 0 commits a checkpoint from.
        """
        tensor = _one_tensor(tensor, "gather")
        self._check_rank(root, "root", "gather")
        route = self._route([tensor], "gather")
        self._check_same_args("gather", [tensor], f"root={root}")
        src = tensor
        if route == "host":
            warn_fallback("gather")
            src = tensor.detach().cpu()
        flat_in = src.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)   # any dtype: bytes are moved
        mine = self.rank == root
        out = [torch.empty_like(flat_in) for _ in range(self.world_size)] if mine else []
        opts = dist.GatherOptions()
        opts.rootRank = root
        self._call(f"gather to rank {root}", self._pg.gather, [out] if mine else [], [flat_in], opts)
        if not mine:
            return None
        return [p.view(tensor.dtype).view(tensor.shape).to(tensor.device) for p in out]

    def barrier(self) -> None:
        """Return once every rank of the group has called ``barrier``.

        A host barrier, on every backend: an NCCL group runs it on its Gloo
        side, so no GPU is touched and no device is guessed (torch's NCCL
        barrier picks one from the rank). CUDA collectives queued before it
        may still be running on the GPU; synchronize first if that matters.
        """
        self._check_usable("barrier")
        opts = dist.BarrierOptions()
        opts.device = torch.device("cpu")
        self._call("barrier", self._pg.barrier, opts)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``, which must call ``recv`` with the same shape and dtype."""
        tensor = _one_tensor(tensor, "send")
        self._check_peer(dst, "dst", "send")
        self._run([tensor.detach().contiguous()], "send", None,
                  lambda ts: self._call(f"send to rank {dst}", self._pg.send, ts, dst, 0), written=())

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` (in place) what rank ``src`` sent with ``send``."""
        tensor = _one_tensor(tensor, "recv")
        self._check_peer(src, "src", "recv")
        self._run([tensor], "recv", None, lambda ts: self._recv_into(ts[0], src))

    def _recv_into(self, tensor, src: int) -> None:
        buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self._call(f"recv from rank {src}", self._pg.recv, [buf], src, 0)
        if buf is not tensor:
            tensor.detach().copy_(buf)

    def _check_peer(self, peer, role: str, what: str) -> None:
        self._check_rank(peer, role, what)
        if peer == self.rank:
            raise InvalidRankError(
                f"{what}: {role}={peer} is this rank itself; point-to-point needs another rank "
                f"(0..{self.world_size - 1} except {self.rank})"
            )

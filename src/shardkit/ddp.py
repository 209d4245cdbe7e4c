"""Data-parallel training: a module wrapper that averages gradients over a :class:`~shardkit.comm.Group`.

:class:`DistributedDataParallel` makes every rank start from rank 0's
parameters and buffers, and during ``backward`` averages the gradients
across the group in buckets of about ``bucket_cap_mb``, each bucket reduced
by one ``Group.all_reduce_`` as soon as its last gradient is accumulated, on
a communication thread so that it overlaps the rest of the backward pass.
When ``backward`` returns, every ``p.grad`` holds the group average.

What it does not do: shard parameters or optimizer state (that is FSDP),
reduce sparse gradients (``UnsupportedOpError``), find unused parameters by
walking the graph, or support double backward through the reduction, or
reentrant activation checkpointing of a parameter also used outside the
checkpointed block (its gradient arrives twice: ``UnsupportedOpError``; use
``use_reentrant=False``). A second ``backward`` of the same forward outside
``no_sync`` reduces again (as torch's DDP does).

Each bucket is reduced in a buffer of its own, and the results are copied
into ``p.grad`` only when the whole ``backward`` has succeeded, in its
final callback: a ``backward`` that raises leaves every ``p.grad`` as local
autograd left it, and nothing writes into them afterwards.

Unused parameters: a trainable parameter that got no gradient on this rank
in a synced step counts as a zero gradient in the average, and its ``grad``
is set to that average; one that no rank used keeps ``grad`` as it was
(``None``), as in one process, so an optimizer skips it. Parameters with
``requires_grad=False`` are broadcast at construction and otherwise left
alone; a change of which parameters require gradients (freezing a layer
after wrapping) is picked up at the next ``forward``, identically on every
rank as every rank runs the same code.

Several wrappers may share one group (a GAN's generator and discriminator):
they share its one communication thread, so their collectives are issued in
the same order on every rank.

Example::

    model = DistributedDataParallel(MyNet(), group)      # group=None: one process, no-op
    for x, y in loader:
        loss_fn(model(x), y).backward()                   # grads averaged over the group
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardkit.comm import ReduceOp
from shardkit.comm.buckets import plan_buckets
from shardkit.errors import UnsupportedOpError

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so that ``backward`` averages its gradients over ``group``.

    ``group=None`` or a group of one rank makes a pass-through wrapper (no
    hooks, no communication). Every rank must wrap the same architecture
    (same parameters, shapes, dtypes, in the same order) and run the same
    number of synced backward passes. Not for use by several threads at once.

    Example::

        ddp = DistributedDataParallel(net, group, bucket_cap_mb=25)
        with ddp.no_sync():
            ddp(x1).sum().backward()      # local accumulation only
        ddp(x2).sum().backward()          # averages the accumulated grads
    """

    def __init__(self, module: torch.nn.Module, group, *, bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self._world_size = 1 if group is None else group.world_size
        self._cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._params: list[torch.nn.Parameter] = []
        self._require_sync = True      # flipped by no_sync()
        self._sync_this_backward = True  # what the last forward with autograd on saw; hooks obey it
        self._handles = []
        self._lock = threading.Lock()  # a module spread over devices runs hooks on one thread per device
        self._reset_step()
        if self._world_size == 1:
            return
        self._broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._comm = _comm_thread(group)
        self._wire(_trainable(module))
        # a wrapper dropped without close() (the module wrapped again) takes its hooks with it
        self._release = weakref.finalize(self, _remove_hooks, self._handles)

    # --- public ------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._world_size > 1:
            self._take_pending()  # a backward that failed midway may have left work behind: dropped
            if self.broadcast_buffers:
                self._broadcast_from_rank0(list(self.module.buffers()))
            trainable = _trainable(self.module)
            if len(trainable) != len(self._params) or any(a is not b for a, b in zip(trainable, self._params)):
                self._wire(trainable)
        if torch.is_grad_enabled():  # an evaluation forward under no_grad runs no backward
            self._sync_this_backward = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Within this block, backward passes of forwards run here only accumulate locally.

        As in torch, what counts is whether the *forward* ran inside the block;
        the next backward of a forward outside it averages everything
        accumulated so far. Does not skip the buffer broadcast.
        """
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def close(self) -> None:
        """Remove the hooks; the module is left as it is (a dropped wrapper does the same)."""
        if self._world_size > 1:
            self._release()

    # --- construction ------------------------------------------------------

    def _wire(self, params: list) -> None:
        """Hooks and buckets for ``params`` (the parameters that require gradients now)."""
        _remove_hooks(self._handles)
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._params, self._names = params, [names.get(id(p), "?") for p in params]
        self._buckets = self._plan(self._cap_bytes)
        self._param_to_bucket = {i: b for b, idx in enumerate(self._buckets) for i in idx}
        self._numels = [[self._params[i].numel() for i in idx] for idx in self._buckets]
        self._bufs: list[torch.Tensor | None] = [None] * len(self._buckets)
        for i, p in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _plan(self, cap_bytes: int) -> list[list[int]]:
        # Gradients become ready roughly in reverse registration order, so the
        # last parameters fill the first bucket and it can launch earliest.
        order = list(reversed(range(len(self._params))))
        sizes = [self._params[i].numel() * self._params[i].element_size() for i in order]
        keys = [(self._params[i].dtype, self._params[i].device) for i in order]
        return [[order[j] for j in bucket] for bucket in plan_buckets(sizes, keys, cap_bytes)]

    @torch.no_grad()
    def _broadcast_from_rank0(self, tensors) -> None:
        if tensors:
            self.group.broadcast_([t.detach() for t in tensors], 0)

    # --- one backward pass ---------------------------------------------------

    def _reset_step(self) -> None:
        self._in_backward = False
        self._missing: list[int] = []   # per bucket: gradients not yet accumulated
        self._ready: set[int] = set()   # parameters whose gradient arrived in this pass
        self._next_bucket = 0           # buckets launch strictly in order on every rank
        self._pending: list[tuple[int, list, object, Future]] = []  # bucket, grads, CUDA stream, future

    def _make_hook(self, i: int):
        wrapper = weakref.ref(self)  # the hook must not keep a dropped wrapper alive (and reducing)

        def hook(_param):
            ddp = wrapper()
            if ddp is not None and ddp._sync_this_backward:
                with ddp._lock:
                    ddp._on_grad_ready(i)
        return hook

    def _on_grad_ready(self, i: int) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._missing = [len(b) for b in self._buckets]
            self._ready, self._next_bucket, self._pending = set(), 0, []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if i in self._ready:
            raise UnsupportedOpError(
                f"DistributedDataParallel: parameter {self._names[i]!r} received its gradient twice in one "
                "backward (reentrant activation checkpointing of a parameter also used outside the "
                "checkpointed block?); each gradient is averaged once per backward. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        self._ready.add(i)
        self._missing[self._param_to_bucket[i]] -= 1
        while self._next_bucket < len(self._buckets) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        grads = [self._params[i].grad for i in self._buckets[b]]
        for i, g in zip(self._buckets[b], grads):
            if g is not None and g.layout != torch.strided:
                raise UnsupportedOpError(
                    f"DistributedDataParallel: parameter {self._names[i]!r} has a {g.layout} gradient; only "
                    "dense gradients are averaged (an nn.Embedding(..., sparse=True)? use sparse=False)"
                )
        buf = self._bucket_buffer(b)
        # CUDA: the stream the gradients were produced on; the reduction is ordered on it
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        future = self._comm.submit(_reduce, self.group, buf, grads, self._numels[b], stream)
        self._pending.append((b, grads, stream, future))
        self._next_bucket = b + 1

    def _bucket_buffer(self, b: int) -> torch.Tensor:
        if self._bufs[b] is None:  # kept: allocated once, not every step
            first = self._params[self._buckets[b][0]]
            count = sum(self._numels[b]) + len(self._numels[b])  # the gradients, then one used-flag each
            self._bufs[b] = torch.empty(count, dtype=first.dtype, device=first.device)
        return self._bufs[b]

    def _finish_backward(self) -> None:
        try:
            while self._next_bucket < len(self._buckets):
                self._launch(self._next_bucket)
        finally:
            done = self._take_pending()
        for b, grads, stream, _ in done:
            if stream is not None:  # this thread's stream (autograd's caller's) waits for the reduction
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._copy_out(b, grads)

    def _take_pending(self) -> list:
        """Wait for every launched bucket, forget them, raise the first failure; the buckets."""
        pending = self._pending
        self._reset_step()
        errors = [f.exception() for *_, f in pending]  # wait for all before raising
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return pending

    @torch.no_grad()
    def _copy_out(self, b: int, grads: list) -> None:
        buf, numels = self._bufs[b], self._numels[b]
        used = (buf[-len(numels):] != 0).tolist()
        dst, src = [], []
        for i, g, view, any_rank in zip(self._buckets[b], grads, buf[:-len(numels)].split(numels), used):
            p = self._params[i]
            if not any_rank:
                continue  # no rank has a gradient for it: left as in one process
            if g is None:
                p.grad = view.view(p.shape).clone()
            else:
                dst.append(g)
                src.append(view.view(g.shape))
        if dst:
            torch._foreach_copy_(dst, src)


def _trainable(module: torch.nn.Module) -> list:
    return [p for p in module.parameters() if p.requires_grad]


def _reduce(group, buf: torch.Tensor, grads: list, numels: list[int], stream) -> None:
    """On the communication thread: pack ``grads`` (None: zeros) and their used-flags into ``buf``, average it.

    ``stream``: for CUDA buffers, the stream the gradients were produced on; the
    copies and the collective are ordered on it.
    """
    with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        _pack_and_average(group, buf, grads, numels)


def _pack_and_average(group, buf: torch.Tensor, grads: list, numels: list[int]) -> None:
    n = len(grads)
    views = buf[:-n].split(numels)
    present = [(v, g.reshape(-1)) for v, g in zip(views, grads) if g is not None]
    if present:
        torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
    for v, g in zip(views, grads):
        if g is None:
            v.zero_()
    buf[-n:].copy_(torch.tensor([g is not None for g in grads], dtype=buf.dtype))
    group.all_reduce_([buf], ReduceOp.AVG)


#: One communication thread per group, shared by every wrapper on it: a group's
#: collectives must be issued in the same order on every rank, so from one thread.
_COMM_THREADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMM_THREADS_LOCK = threading.Lock()


def _comm_thread(group) -> ThreadPoolExecutor:
    with _COMM_THREADS_LOCK:
        executor = _COMM_THREADS.get(group)
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-ddp")
            _COMM_THREADS[group] = executor
            weakref.finalize(group, executor.shutdown, wait=False)
        return executor


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()

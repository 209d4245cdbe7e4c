"""Data-parallel training: a module wrapper that averages gradients over a :class:`~shardkit.comm.Group`.

:class:`DistributedDataParallel` makes every rank start from rank 0's
parameters and buffers, and during ``backward`` averages the gradients
across the group in buckets of about ``bucket_cap_mb``, each bucket reduced
by one ``Group.all_reduce_`` as soon as its last gradient is accumulated, on
a communication thread so that it overlaps the rest of the backward pass.
When ``backward`` returns, every ``p.grad`` holds the group average.

What it does not do: shard parameters or optimizer state (that is FSDP),
reduce sparse gradients, find unused parameters by walking the graph, or
support double backward through the reduction. A second ``backward`` of the
same forward outside ``no_sync`` reduces again (as torch's DDP does).

Unused parameters: a trainable parameter that got no gradient on this rank
in a synced step counts as a **zero gradient** in the average, and its
``grad`` is set to that average (a zero tensor if no rank used it), so the
ranks' parameters never drift apart. Parameters with ``requires_grad=False``
are broadcast at construction and otherwise left alone.

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
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._require_sync = True      # flipped by no_sync()
        self._sync_this_backward = True  # what the last forward saw; hooks obey it
        self._handles = []
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # a module spread over devices runs hooks on one thread per device
        self._reset_step()
        if self._world_size == 1:
            return
        self._broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._buckets = self._plan(int(bucket_cap_mb * 1024 * 1024))
        self._param_to_bucket = {i: b for b, idx in enumerate(self._buckets) for i in idx}
        for i, p in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-ddp")
        # a wrapper dropped without close() (the module wrapped again) takes its hooks and thread with it
        self._release = weakref.finalize(self, _release, self._handles, self._executor)

    # --- public ------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._world_size > 1:
            self._wait_pending()  # a backward that failed midway may have left work behind
            if self.broadcast_buffers:
                self._broadcast_from_rank0(list(self.module.buffers()))
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
        """Remove the hooks and stop the communication thread; the module is left as it is.

        A wrapper that is dropped (garbage-collected) without ``close()`` does the same.
        """
        if self._executor is not None:
            self._release()
            self._executor = None

    # --- construction ------------------------------------------------------

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
        self._next_bucket = 0           # buckets launch strictly in order on every rank
        self._futures: list[Future] = []

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
            self._next_bucket, self._futures = 0, []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._missing[self._param_to_bucket[i]] -= 1
        while self._next_bucket < len(self._buckets) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        grads = []
        for i in self._buckets[b]:
            p = self._params[i]
            if p.grad is None:  # unused on this rank: counts as zero (see the module docstring)
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            grads.append(p.grad)
        self._futures.append(self._executor.submit(self.group.all_reduce_, grads, ReduceOp.AVG))
        self._next_bucket = b + 1

    def _finish_backward(self) -> None:
        try:
            while self._next_bucket < len(self._buckets):
                self._launch(self._next_bucket)
        finally:
            self._wait_pending()

    def _wait_pending(self) -> None:
        futures = self._futures
        self._reset_step()
        errors = [f.exception() for f in futures]  # wait for all before raising
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def _release(handles: list, executor: ThreadPoolExecutor) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    executor.shutdown(wait=True)

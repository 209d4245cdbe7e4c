"""shardkit.ddp.DistributedDataParallel: equal to one process training on the whole batch.

Ranks are threads of ``Group.local`` (fast) and, once, real Gloo processes
(``comm_ranks.spawn_ranks``). Everything is float64 so "equal" can be tight.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from comm_ranks import spawn_ranks
from comm_threads import on_threads
from shardkit.comm import Group, UniqueId
from shardkit.ddp import DistributedDataParallel
from shardkit.errors import CommError, UnsupportedOpError

F64 = torch.float64
TINY_BUCKETS_MB = 200 / 2**20  # ~200 bytes: several buckets, launched during backward
# Rank threads share torch's global RNG: seeding and initialising a model must not interleave.
INIT_LOCK = threading.RLock()


@pytest.fixture
def groups2():
    gs = Group.local(2)
    yield gs
    for g in gs:
        g.close()


def make_net(seed: int) -> nn.Module:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)


def batch(step: int, rank: int, rows: int = 4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 6, generator=g, dtype=F64), torch.randn(rows, 3, generator=g, dtype=F64)


def params_of(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def train_rank(group, steps: int, bucket_cap_mb: float = 25, micro: int = 1):
    """SGD on this rank's data; ``micro`` > 1 accumulates micro-batches under ``no_sync``."""
    rank = 0 if group is None else group.rank
    net = make_net(seed=100 + rank)  # different on every rank: DDP must start them equal
    ddp = DistributedDataParallel(net, group, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.5)
    local_grads = []
    for s in range(steps):
        for m in range(micro):
            x, y = batch(s * micro + m, rank)
            ctx = ddp.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                (nn.functional.mse_loss(ddp(x), y) / micro).backward()
            if m < micro - 1:
                local_grads.append(params_of_grads(net))
        opt.step()
        opt.zero_grad()
    ddp.close()
    return params_of(net), local_grads


def params_of_grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def train_reference(world_size: int, steps: int, micro: int = 1):
    """One process, the same steps on every rank's (and micro-batch's) data at once."""
    net = make_net(seed=100)
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.5)
    for s in range(steps):
        parts = [batch(s * micro + m, r) for m in range(micro) for r in range(world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params_of(net)


def assert_all_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bucket_cap_mb", [25, TINY_BUCKETS_MB])
def test_two_ranks_equal_each_other_and_the_single_process_reference(groups2, bucket_cap_mb):
    (p0, _), (p1, _) = on_threads(groups2, train_rank, 3, bucket_cap_mb)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert_all_close(p0, train_reference(2, 3))


def test_three_ranks_many_buckets():
    groups = Group.local(3)
    try:
        results = on_threads(groups, train_rank, 2, TINY_BUCKETS_MB)
    finally:
        for g in groups:
            g.close()
    for params, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))
    assert_all_close(results[0][0], train_reference(3, 2))


def test_no_sync_accumulation_equals_one_big_step(groups2):
    (p0, local0), (p1, local1) = on_threads(groups2, train_rank, 2, TINY_BUCKETS_MB, 3)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert_all_close(p0, train_reference(2, 2, micro=3))
    # inside no_sync nothing was exchanged: the ranks' local gradients differ
    assert not torch.equal(local0[0][0], local1[0][0])


def _buffers(group, broadcast_buffers):
    net = nn.BatchNorm1d(3).to(F64)  # deterministic init: no RNG
    net.running_mean.fill_(float(group.rank + 1))
    ddp = DistributedDataParallel(net, group, broadcast_buffers=broadcast_buffers)
    at_start = net.running_mean.clone()
    if group.rank == 1:
        net.running_var.fill_(7.0)  # rank 1 drifts; the next forward decides who wins
    before_forward = []
    orig_forward = net.forward

    def spy(x):
        before_forward.append(net.running_var.clone())
        return orig_forward(x)

    net.forward = spy
    ddp(torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(group.rank)))
    return at_start, before_forward[0]


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_start_equal_and_are_broadcast_before_forward(groups2, broadcast_buffers):
    (start0, var0), (start1, var1) = on_threads(groups2, _buffers, broadcast_buffers)
    assert torch.equal(start0, torch.ones(3, dtype=F64)) and torch.equal(start1, start0)
    assert torch.equal(var0, torch.ones(3, dtype=F64))
    expected = torch.ones(3, dtype=F64) if broadcast_buffers else torch.full((3,), 7.0, dtype=F64)
    assert torch.equal(var1, expected)


class TwoHeads(nn.Module):
    def __init__(self, seed):
        super().__init__()
        with INIT_LOCK:
            torch.manual_seed(seed)
            self.body = nn.Linear(4, 4).to(F64)
            self.frozen = nn.Linear(4, 4).to(F64).requires_grad_(False)
            self.a = nn.Linear(4, 1).to(F64)
            self.b = nn.Linear(4, 1).to(F64)
            self.never = nn.Linear(4, 1).to(F64)

    def forward(self, x, use_b):
        h = self.frozen(torch.tanh(self.body(x)))
        return self.a(h) + (self.b(h) if use_b else 0)


def _frozen_and_unused(group):
    net = TwoHeads(seed=group.rank)
    frozen_at_start = params_of(net.frozen)
    ddp = DistributedDataParallel(net, group, bucket_cap_mb=TINY_BUCKETS_MB)
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(group.rank))
    ddp(x, use_b=group.rank == 0).sum().backward()
    # what rank 0 would get alone, for head b
    solo = TwoHeads(seed=0)
    solo(x, use_b=True).sum().backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in net.named_parameters()}
    return frozen_at_start, params_of(net.frozen), grads, params_of_grads(solo.b)


def test_frozen_param_is_broadcast_only_and_unused_param_counts_as_zero_where_another_rank_used_it(groups2):
    (f_start0, f0, g0, solo_b), (f_start1, f1, g1, _) = on_threads(groups2, _frozen_and_unused)
    assert not torch.equal(f_start0[0], f_start1[0])  # they did start different
    assert all(torch.equal(a, b) for a, b in zip(f0, f1))
    assert all(torch.equal(a, b) for a, b in zip(f0, f_start0))
    assert g0["frozen.weight"] is None and g1["frozen.weight"] is None
    for name in g0:
        if g0[name] is not None:
            assert torch.equal(g0[name], g1[name]), name
    # b used on rank 0 only: average of rank 0's gradient and zero
    torch.testing.assert_close(g0["b.weight"], solo_b[0] / 2, rtol=1e-12, atol=1e-12)
    # never used anywhere: no gradient, as in one process (an optimizer then skips it)
    assert g0["never.weight"] is None and g1["never.weight"] is None


def test_world_size_one_and_no_group_are_pass_through():
    (plain, _) = train_rank(None, 2)
    assert_all_close(plain, train_reference(1, 2))
    (g,) = Group.local(1)
    with g:
        (one, _) = train_rank(g, 2)
    assert all(torch.equal(a, b) for a, b in zip(plain, one))
    net = make_net(0)
    ddp = DistributedDataParallel(net, None)
    assert ddp.module is net
    x = torch.ones(2, 6, dtype=F64)
    assert torch.equal(ddp(x), net(x))
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert net[0].weight.grad is not None


def _proc_train(rank, world_size, uid_bytes, steps):
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), backend="gloo", timeout=30) as g:
        params, _ = train_rank(g, steps, TINY_BUCKETS_MB, 2)
        return [p.tolist() for p in params]  # plain lists survive the rank's exit


def test_real_gloo_processes_match_the_reference():
    p0, p1 = spawn_ranks(_proc_train, 2, 2)
    assert p0 == p1
    assert_all_close([torch.tensor(p, dtype=F64) for p in p0], train_reference(2, 2, micro=2))


def _backward_on_closed_group(group):
    ddp = DistributedDataParallel(make_net(0), group, bucket_cap_mb=TINY_BUCKETS_MB)
    group.close()
    with pytest.raises(CommError):
        ddp(torch.ones(2, 6, dtype=F64)).sum().backward()
    # the failed step left nothing behind: a no_sync step still works
    with ddp.no_sync():
        ddp(torch.ones(2, 6, dtype=F64)).sum().backward()
    return True


def test_a_failed_reduction_raises_from_backward_instead_of_hanging(groups2):
    assert on_threads(groups2, _backward_on_closed_group) == [True, True]


def _rewrap_after_a_closed_group(group, fresh_groups):
    import gc

    fresh = fresh_groups[group.rank]
    net = make_net(seed=7)
    first = DistributedDataParallel(net, group)
    group.close()  # the first group failed: wrap the same module again on a new one
    del first
    gc.collect()
    second = DistributedDataParallel(net, fresh)
    x, y = batch(0, fresh.rank)
    nn.functional.mse_loss(second(x), y).backward()  # only the live wrapper's hooks reduce
    grads = params_of_grads(net)
    second.close()
    return grads


def test_a_dropped_wrapper_stops_reducing_so_the_module_can_be_wrapped_again(groups2):
    fresh = Group.local(2)
    try:
        g0, g1 = on_threads(groups2, _rewrap_after_a_closed_group, fresh)
    finally:
        for g in fresh:
            g.close()
    assert_all_close(g0, g1)  # averaged on the fresh group, equal on both ranks


# --- found by review: wrong or diverging gradients ---------------------------------------------


def _chain(seed: int) -> nn.Module:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)]).to(F64)


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(10 * step + rank))


def _two_wrappers(group, steps):
    a, b = _chain(1), _chain(2)
    da = DistributedDataParallel(a, group, bucket_cap_mb=64 / 2**20)
    db = DistributedDataParallel(b, group, bucket_cap_mb=64 / 2**20)
    out = []
    for s in range(steps):
        for p in [*a.parameters(), *b.parameters()]:
            p.grad = None
        db(da(_x(s, group.rank))).pow(2).sum().backward()
        out.append(params_of_grads(a) + params_of_grads(b))
    return out


def test_two_wrappers_on_one_group_average_like_one_process(groups2):
    # Each wrapper had its own communication thread: two threads issued collectives on one group, in
    # an order that differed between the ranks, and most steps got wrong, diverging gradients.
    steps = 40
    r0, r1 = on_threads(groups2, _two_wrappers, steps)
    a, b = _chain(1), _chain(2)
    for s in range(steps):
        for p in [*a.parameters(), *b.parameters()]:
            p.grad = None
        for r in range(2):
            (b(a(_x(s, r))).pow(2).sum() / 2).backward()
        assert_all_close(r0[s], params_of_grads(a) + params_of_grads(b))
        assert all(torch.equal(u, v) for u, v in zip(r0[s], r1[s]))


class _FailOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("a bad batch")
        return grad, None


def _biased(seed: int) -> nn.Module:
    with INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Linear(4, 4).to(F64)


def _retry_after_a_failed_backward(group):
    a, b = _biased(3), _biased(4)
    fail = [True]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x):
            return self.b(_FailOnce.apply(self.a(x), fail[0]))

    # 160-byte buckets: b's weight and bias share the first one, launched before the failure
    ddp = DistributedDataParallel(Net(), group, bucket_cap_mb=160 / 2**20)
    x = torch.ones(2, 4, dtype=F64) * (group.rank + 1)
    with pytest.raises(RuntimeError, match="a bad batch"):
        ddp(x).sum().backward()
    for p in ddp.parameters():  # optimizer.zero_grad(set_to_none=False), as the reduction still runs
        if p.grad is not None:
            p.grad.zero_()
    fail[0] = False
    ddp(x).sum().backward()
    return params_of_grads(ddp.module)


def test_a_failed_backward_leaves_nothing_that_lands_in_the_next_steps_gradients(groups2, monkeypatch):
    # The reduction of a bucket launched before backward raised went on, and copied its result into
    # p.grad after the user had zeroed it: the retried step got the failed step's average added in.
    import shardkit.comm.collectives as collectives

    real_unpack = collectives.unpack

    def late_unpack(flat, tensors):  # a slow link: the result lands after zero_grad
        import time

        time.sleep(0.3)
        real_unpack(flat, tensors)

    monkeypatch.setattr(collectives, "unpack", late_unpack)
    g0, g1 = on_threads(groups2, _retry_after_a_failed_backward)
    a, b = _biased(3), _biased(4)
    for r in range(2):
        (b(a(torch.ones(2, 4, dtype=F64) * (r + 1))).sum() / 2).backward()
    assert_all_close(g0, params_of_grads(a) + params_of_grads(b))
    assert_all_close(g1, g0)


def _freeze_and_unfreeze_after_wrapping(group):
    net = make_net(seed=5 + group.rank)
    ddp = DistributedDataParallel(net, group)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    net[0].requires_grad_(False)
    frozen = params_of(net[0])
    x, y = batch(0, group.rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    frozen_grads = [p.grad for p in net[0].parameters()]
    moved = [not torch.equal(a, b) for a, b in zip(frozen, params_of(net[0]))]
    opt.zero_grad()
    net[0].requires_grad_(True)  # unfrozen again: averaged again
    x, y = batch(1, group.rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    return frozen_grads, moved, params_of_grads(net[0])


def test_parameters_frozen_or_unfrozen_after_wrapping_are_picked_up_at_the_next_forward(groups2):
    # Frozen after wrapping, a parameter got a zero gradient and AdamW's weight decay moved it;
    # unfrozen after wrapping, it had no hook and its gradient was never averaged.
    (fg0, moved0, ug0), (fg1, moved1, ug1) = on_threads(groups2, _freeze_and_unfreeze_after_wrapping)
    assert fg0 == [None, None] and fg1 == [None, None]
    assert moved0 == [False, False] and moved1 == [False, False]
    assert all(torch.equal(u, v) for u, v in zip(ug0, ug1))


def _reentrant_checkpoint(group):
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with INIT_LOCK:
                torch.manual_seed(0)
                self.w = nn.Parameter(torch.randn(4, 4, dtype=F64) / 2)
                self.inner = nn.Linear(4, 4, bias=False).to(F64)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.inner(t) @ self.w), x, use_reentrant=True)
            return (h @ self.w).pow(2).sum()

    ddp = DistributedDataParallel(Net(), group)
    with pytest.raises(UnsupportedOpError, match="'w' received its gradient twice.*use_reentrant=False"):
        ddp(torch.ones(2, 4, dtype=F64, requires_grad=True)).backward()
    return True


def test_a_gradient_arriving_twice_in_one_backward_is_refused_not_averaged_early(groups2):
    assert on_threads(groups2, _reentrant_checkpoint) == [True, True]


def _sparse(group):
    with INIT_LOCK:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 2, sparse=True).to(F64)
    ddp = DistributedDataParallel(emb, group)
    with pytest.raises(UnsupportedOpError, match="'weight' has a torch.sparse_coo gradient.*sparse=False"):
        ddp(torch.tensor([1, 2])).sum().backward()
    return True


def test_a_sparse_gradient_is_refused_with_a_clear_error(groups2):
    assert on_threads(groups2, _sparse) == [True, True]


def _eval_forward_inside_no_sync(group):
    net = make_net(seed=9 + group.rank)
    ddp = DistributedDataParallel(net, group)
    x, y = batch(0, group.rank)
    loss = nn.functional.mse_loss(ddp(x), y)
    with torch.no_grad(), ddp.no_sync():
        ddp(x)  # an evaluation forward must not turn off the pending backward's averaging
    loss.backward()
    return params_of_grads(net)


def test_a_no_grad_forward_does_not_change_whether_the_pending_backward_averages(groups2):
    g0, g1 = on_threads(groups2, _eval_forward_inside_no_sync)
    assert all(torch.equal(u, v) for u, v in zip(g0, g1))

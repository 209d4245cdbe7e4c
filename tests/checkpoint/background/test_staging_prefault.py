"""The first save_async: fresh staging buffers are faulted in ahead of the copy, and the snapshot still holds.

A first save allocates its staging buffers; ``staging.copy_host`` then
faults them in on one helper job, batch by batch, while the copies follow.
These tests pin what the caller relies on: once ``save_async`` returns, the
checkpoint holds the values of that moment however the caller mutates its
tensors, on the first save as on later ones; no batch is copied into before
its pages were faulted in; reused buffers are not faulted again; and with the
kernel call unavailable or the knob off, the copies are the same.
"""

from __future__ import annotations


import pytest
import torch

from shardkit import knobs
from shardkit.checkpoint import AsyncCheckpointer, ShardMetadata, TensorShardSpec, load_distributed
import shardkit.checkpoint.background.staging as staging
from shardkit.storage.fast_io.prefault import PAGE_BYTES

import shardkit.checkpoint.background.checkpointer as async_save


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 257, generator=g),          # many batches at 64 KiB
                  "h": torch.randn(1000, 33, generator=g).to(torch.bfloat16),
                  "t": torch.randn(40, 50, generator=g).t()},        # non-contiguous: copy_ path
        "optim": {"state": [{"m": torch.randn(70_000, generator=g), "step": 3}]},
        "tiny": torch.ones(3),
    }


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        return {}
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _mutate(state) -> None:
    for t in _tensors(state).values():
        t.add_(1)


class Recorder:
    """Wraps populate_for_write and copy_bytes in staging, recording what each touched, in order."""

    def __init__(self, monkeypatch, *, populate_works: bool = True):
        self.events = []
        real_populate, real_copy = staging.populate_for_write, staging.copy_bytes

        def populate(addr, nbytes):
            self.events.append(("fault", addr, nbytes))
            return real_populate(addr, nbytes) if populate_works else False

        def copy(dst, src, nbytes):
            self.events.append(("copy", dst, nbytes))
            real_copy(dst, src, nbytes)

        monkeypatch.setattr(staging, "populate_for_write", populate)
        monkeypatch.setattr(staging, "copy_bytes", copy)

    def faults(self):
        return [e for e in self.events if e[0] == "fault"]


@pytest.fixture
def fake_write(monkeypatch):
    calls = []
    monkeypatch.setattr(async_save, "_save_staged", lambda staged, *a, **k: calls.append(staged))
    return calls


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 16 * PAGE_BYTES)


@pytest.mark.parametrize("threads", [1, 3])
def test_first_save_snapshot_holds_while_the_caller_mutates(fake_write, small_batches, monkeypatch, tmp_path, threads):
    monkeypatch.setattr(knobs, "IO_THREADS", threads)
    rec = Recorder(monkeypatch)
    state = _state()
    expect = {k: t.clone() for k, t in _tensors(state).items()}
    ckpt = AsyncCheckpointer(tmp_path / "ck", 0, 1, None)  # fresh: the first save allocates its buffers
    future = ckpt.save_async(state)
    _mutate(state)
    future.wait()
    staged = _tensors(fake_write[0])
    assert staged.keys() == expect.keys()
    for name, t in expect.items():
        assert torch.equal(staged[name], t), name
    assert len(rec.faults()) > 10  # the fresh buffers were faulted in, batch by batch
    ckpt.close()


@pytest.mark.parametrize("threads", [2, 4])
def test_no_batch_is_copied_into_before_its_pages_were_faulted(small_batches, monkeypatch, threads):
    monkeypatch.setattr(knobs, "IO_THREADS", threads)
    monkeypatch.setattr(staging.os, "cpu_count", lambda: 4)  # up to 3 helpers, whatever this machine has
    rec = Recorder(monkeypatch)
    staging.stage(_state(), {})
    faulted = []
    for kind, addr, nbytes in rec.events:
        if kind == "fault":
            faulted.append((addr, addr + nbytes))
        else:
            assert any(lo <= addr and addr + nbytes <= hi for lo, hi in faulted), "copied before faulted"
    assert len(faulted) == len(set(faulted))  # several helpers: each batch faulted once
    copies = [e for e in rec.events if e[0] == "copy"]
    assert len(faulted) == len(copies)  # every tensor here is fresh and contiguous but "t" (copy_ path)


def test_reused_buffers_are_not_faulted_again_and_get_the_new_values(small_batches, monkeypatch):
    rec = Recorder(monkeypatch)
    state = _state()
    _, buffers = staging.stage(state, {})
    first_faults = len(rec.faults())
    _mutate(state)
    staged, _ = staging.stage(state, buffers)
    assert len(rec.faults()) == first_faults
    for name, t in _tensors(state).items():
        assert torch.equal(_tensors(staged)[name], t), name


@pytest.mark.parametrize("case", ["kernel without the advice", "knob off"])
def test_without_prefault_the_copies_are_the_same(small_batches, monkeypatch, case):
    rec = Recorder(monkeypatch, populate_works=case != "kernel without the advice")
    if case == "knob off":
        monkeypatch.setattr(knobs, "STAGING_PREFAULT", False)
    state = _state(1)
    staged, _ = staging.stage(state, {})
    for name, t in _tensors(state).items():
        assert torch.equal(_tensors(staged)[name], t), name
    assert (rec.faults() == []) == (case == "knob off")


def test_a_failing_prefault_releases_every_copy_and_raises(small_batches, monkeypatch):
    monkeypatch.setattr(knobs, "IO_THREADS", 3)

    def broken(addr, nbytes):
        raise RuntimeError("prefault broke")

    monkeypatch.setattr(staging, "populate_for_write", broken)
    with pytest.raises(RuntimeError, match="prefault broke"):  # no copy is left waiting: this returns
        staging.stage(_state(), {})


def test_first_real_save_on_disk_holds_the_values_at_call_time(small_batches, monkeypatch, tmp_path):
    monkeypatch.setattr(knobs, "IO_THREADS", 3)
    state = _state(2)
    expect = {k: t.clone() for k, t in _tensors(state).items()}
    spec = ShardMetadata(1, {"model.w": TensorShardSpec((300, 257), 0, (300,))})
    with AsyncCheckpointer(tmp_path / "ck", 0, 1, spec) as ckpt:
        future = ckpt.save_async(state)
        for _ in range(5):  # "training" right after the call returns
            _mutate(state)
        future.wait()
    loaded = _tensors(load_distributed(tmp_path / "ck", 0, 1))
    for name, t in expect.items():
        assert torch.equal(loaded[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name

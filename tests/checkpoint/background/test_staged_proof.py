"""Incremental background saves prove unchanged tensors against their staging buffers, never against
bytes that may differ: every case where the buffer is not what the base keeps falls back to the base file."""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit import knobs
from shardkit.checkpoint import api
from shardkit.checkpoint.background.staging import stage_against
from shardkit.checkpoint.saving import incremental
from shardkit.errors import AsyncCheckpointError


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(256, 64, generator=g), "emb": torch.randn(64, 16, generator=g).bfloat16(),
            "ids": torch.arange(300, dtype=torch.int64), "lora": torch.zeros(8, 64)}


@pytest.fixture
def compared(monkeypatch):
    """The names each incremental save compared with its base file, one set per save."""
    seen: list[set[str]] = []
    real = incremental.ByteProof

    def spy(candidates, **kwargs):
        seen.append({c.name for c in candidates})
        return real(candidates, **kwargs)

    monkeypatch.setattr(incremental, "ByteProof", spy)
    return seen


def _refs(d) -> dict[str, str]:
    """tensor name -> the sibling directory its first chunk is read from (its own: '')."""
    with open(os.path.join(d, "metadata.json")) as f:
        meta = json.load(f)
    dirs = [b["dir"] for b in meta.get("bases", [])]
    return {n: dirs[t["chunks"][0]["base"]] if "base" in t["chunks"][0] else ""
            for n, t in meta["tensor_specs"].items()}


def _loads_exactly(d, state: dict) -> None:
    out = {k: torch.empty_like(v) for k, v in state.items()}
    ck.load(out, str(d))
    for k, v in state.items():
        assert torch.equal(out[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    assert ck.validate_distributed(str(d)).ok


def test_unchanged_tensors_are_proven_by_the_staging_buffers_not_the_base_file(tmp_path, compared):
    state = _state()
    ck.async_save(state, str(tmp_path / "s0")).wait()
    state["lora"].add_(1)
    ck.async_save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0")).wait()
    assert compared == [{"lora"}]     # the three unchanged ones never touched s0's file
    assert _refs(tmp_path / "s1") == {"frozen": "s0", "emb": "s0", "ids": "s0", "lora": ""}
    _loads_exactly(tmp_path / "s1", state)
    state["lora"].add_(1)               # a chain: s2 on s1, whose unchanged tensors are in s0's file
    ck.async_save(state, str(tmp_path / "s2"), base=str(tmp_path / "s1")).wait()
    assert compared[1] == {"lora"}
    assert _refs(tmp_path / "s2") == {"frozen": "s0", "emb": "s0", "ids": "s0", "lora": ""}
    _loads_exactly(tmp_path / "s2", state)


def test_a_base_saved_again_since_is_compared_with_its_file(tmp_path, compared):
    state = _state()
    ck.async_save(state, str(tmp_path / "s0")).wait()
    ck.save(_state(seed=1), str(tmp_path / "s0"))   # s0 now keeps other bytes than the staging buffers
    ck.async_save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0")).wait()
    assert compared == [set(state)]
    assert _refs(tmp_path / "s1")["ids"] == "s0"    # equal in both: referenced after the byte comparison
    _loads_exactly(tmp_path / "s1", state)


def test_a_base_other_than_the_last_save_is_compared_with_its_file(tmp_path, compared):
    state = _state()
    ck.async_save(state, str(tmp_path / "s0")).wait()
    state["frozen"].add_(1)
    ck.async_save(state, str(tmp_path / "s1")).wait()      # the buffers now hold s1's bytes
    ck.async_save(state, str(tmp_path / "s2"), base=str(tmp_path / "s0")).wait()
    assert compared == [set(state)]
    _loads_exactly(tmp_path / "s2", state)


def test_a_failed_save_leaves_nothing_to_prove_with(tmp_path, compared, monkeypatch):
    state = _state()
    ck.async_save(state, str(tmp_path / "s0")).wait()
    real = api.write_and_commit

    def fail(*args, **kwargs):
        raise OSError(5, "the disk went away")

    monkeypatch.setattr(api, "write_and_commit", fail)
    state["frozen"].add_(1)
    with pytest.raises(AsyncCheckpointError):
        ck.async_save(state, str(tmp_path / "bad")).wait()    # staged s0's buffers over, then failed
    monkeypatch.setattr(api, "write_and_commit", real)
    state["frozen"].sub_(1)                                     # back to s0's values: the buffers hold others
    ck.async_save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0")).wait()
    assert compared == [set(state)]
    _loads_exactly(tmp_path / "s1", state)


def _hold_writes(monkeypatch, held: str, failing: str | None = None) -> threading.Event:
    """Background saves into a directory ending with ``held`` wait for the returned event before they
    write; those ending with ``failing`` fail there."""
    gate, real = threading.Event(), api.write_and_commit

    def gated(prep, storage, directory, *args, **kwargs):
        if directory.endswith(held):
            assert gate.wait(30)
        if failing is not None and directory.endswith(failing):
            raise OSError(5, "the disk went away")
        return real(prep, storage, directory, *args, **kwargs)

    monkeypatch.setattr(api, "write_and_commit", gated)
    return gate


def test_buffers_of_a_failed_queued_save_prove_nothing_against_the_save_before_it(tmp_path, compared, monkeypatch):
    # A is in flight while B stages into buffers of its own; A commits, B fails. The buffers kept are B's
    # (they hold B's values), the record A's: the next save must not take B's buffers for A's bytes.
    gate = _hold_writes(monkeypatch, held="/A", failing="/B")
    state = _state()
    a = ck.async_save(state, str(tmp_path / "A"))
    state["frozen"].add_(1)
    b = ck.async_save(state, str(tmp_path / "B"))
    gate.set()
    a.wait()
    with pytest.raises(AsyncCheckpointError):
        b.wait()
    ck.async_save(state, str(tmp_path / "C"), base=str(tmp_path / "A")).wait()
    assert compared == [set(state)]
    _loads_exactly(tmp_path / "C", state)


def test_a_save_staged_while_another_is_in_flight_is_compared_with_the_base_file(tmp_path, compared, monkeypatch):
    gate = _hold_writes(monkeypatch, held="/s0")
    state = _state()
    first = ck.async_save(state, str(tmp_path / "s0"))
    second = ck.async_save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0"))   # fresh buffers
    gate.set()
    first.wait()
    second.wait()
    assert compared == [set(state)]
    _loads_exactly(tmp_path / "s1", state)


def test_a_view_that_is_not_one_run_of_bytes_is_compared_with_the_base_file(tmp_path, compared):
    base = torch.randn(64, 64)
    state = {"t": base.t(), "plain": torch.ones(100)}
    ck.async_save(state, str(tmp_path / "s0")).wait()
    ck.async_save(state, str(tmp_path / "s1"), base=str(tmp_path / "s0")).wait()
    assert compared == [{"t"}]
    _loads_exactly(tmp_path / "s1", {"t": base.t().contiguous(), "plain": state["plain"]})


def test_the_manager_proves_from_staging_along_a_chain_and_resumes_exactly(tmp_path, compared):
    state = _state()
    with ck.CheckpointManager(str(tmp_path / "run"), incremental=True, keep_last=2) as manager:
        for step in range(4):
            state["lora"].add_(1)
            manager.save(step, state)
        manager.wait()
    assert compared == [{"lora"}] * 3     # step 0 has no base
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with ck.CheckpointManager(str(tmp_path / "run"), incremental=True) as manager:
        assert manager.restore(out) == 3
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("where", [0, "last"])
def test_stage_against_reports_a_leaf_unchanged_only_when_every_byte_matches(monkeypatch, where):
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 4096)     # many pieces, several jobs
    src = {"a": torch.randn(10_000), "b": torch.randn(10_000)}
    _, buffers = stage_against(src, {})[:2]
    src["a"].view(torch.uint8)[0 if where == 0 else -1] ^= 1
    staged, used, same = stage_against(src, buffers, compare={("a",), ("b",)})
    assert same == {("b",)}
    assert all(used[(k,)] is buffers[(k,)] for k in src)
    assert all(torch.equal(staged[k], src[k]) for k in src)    # the differing piece was copied


def test_closing_the_manager_frees_the_buffers_the_proof_kept(tmp_path, monkeypatch):
    from shardkit.checkpoint.background import staged_proof

    kept, real = [], staged_proof.keep

    def spy(key, record):
        kept.extend(weakref.ref(h.buffer) for h in (record.held.values() if record else ()))
        real(key, record)

    monkeypatch.setattr(staged_proof, "keep", spy)
    state = _state()
    with ck.CheckpointManager(str(tmp_path / "run"), incremental=True) as manager:
        manager.save(0, state)
        manager.save(1, state)
    gc.collect()
    assert kept and all(ref() is None for ref in kept)

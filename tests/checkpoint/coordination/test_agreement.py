"""One step of a group save (``group.settle``, ``agreement.agree``) on Group.local thread ranks.

Statuses go to rank 0 only (a gather), rank 0's verdict to every rank (a
broadcast); a value longer than its slot, or a long verdict, costs one more
round of the same collectives, never an all-gather. A failure on any rank,
or in rank 0's commit, fails the step on every rank, typed, none blocked.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, save_distributed
from shardkit.checkpoint.coordination.agreement import FIRST_STEP, agree, attempt, describe
from shardkit.checkpoint.coordination.group import BROADCAST_SLOT_BYTES, EXCHANGE_OBSERVERS, broadcast_json, settle
from shardkit.comm import Group
from shardkit.errors import CheckpointBusyError, CheckpointError

from comm_threads import on_threads

N = 3
SLOT = 48


@pytest.fixture(scope="module")
def groups():
    gs = Group.local(N, timeout=30)
    yield gs
    for g in gs:
        g.close()


def _counted(groups, fn):
    """``fn(g)`` on every rank; (results, collectives per rank, bytes rank 0 received)."""
    collectives, received = [0] * N, [0] * N

    def observe(rank, n, got, sent):
        collectives[rank] += n
        received[rank] += got

    EXCHANGE_OBSERVERS.append(observe)
    try:
        out = on_threads(groups, fn)
    finally:
        EXCHANGE_OBSERVERS.remove(observe)
    return out, collectives, received


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 3 * SLOT), min_size=N, max_size=N), verdict_chars=st.integers(0, 300))
def test_rank0_sees_every_value_and_every_rank_its_verdict_whatever_the_lengths(groups, lengths, verdict_chars):
    def one(g):
        value = {"rank": g.rank, "text": "é" * (lengths[g.rank] // 2)}        # 2 bytes a character
        return settle(g, value, lambda values: {"seen": values, "pad": "x" * verdict_chars}, "a step",
                      slot_bytes=SLOT)

    out, collectives, _ = _counted(groups, one)
    want = [{"rank": r, "text": "é" * (lengths[r] // 2)} for r in range(N)]
    assert out == [{"seen": want, "pad": "x" * verdict_chars}] * N
    # A gather and a broadcast; a value past its slot adds a broadcast and a gather, a verdict past
    # the broadcast slot one broadcast: every rank issues the same.
    overflow = any(len(_json(v)) > SLOT - 8 for v in want)
    long_verdict = len(_json({"verdict": out[0]})) > BROADCAST_SLOT_BYTES - 8
    assert collectives == [2 + 2 * overflow + long_verdict] * N


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def test_rank0_receives_one_slot_per_other_rank_when_the_values_fit(groups):
    _, collectives, received = _counted(groups, lambda g: settle(g, {"error": None}, lambda v: True, "x",
                                                                   slot_bytes=32))
    assert collectives == [2] * N
    assert received == [(N - 1) * 32, BROADCAST_SLOT_BYTES, BROADCAST_SLOT_BYTES]


def test_a_decision_that_raises_on_rank0_fails_every_rank_and_the_group_goes_on(groups):
    def one(g):
        try:
            settle(g, {"error": None}, lambda values: 1 / 0, "checking the layouts")
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    errors = on_threads(groups, one)
    assert isinstance(errors[0], ZeroDivisionError)
    for e in errors[1:]:
        assert isinstance(e, CheckpointError)
        assert "failed on rank 0 while checking the layouts: ZeroDivisionError" in str(e)
    assert on_threads(groups, lambda g: broadcast_json(g, g.rank)) == [0] * N      # nothing left pending


def _agree_failing(groups, failing_rank, exc, **kw):
    def one(g):
        _, own = attempt(lambda: (_ for _ in ()).throw(exc) if g.rank == failing_rank else None)
        try:
            return agree(g, {"error": describe(own)}, own, FIRST_STEP, **kw)
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    return on_threads(groups, one)


def test_a_failure_on_one_rank_fails_the_step_on_every_rank_with_its_message():
    gs = Group.local(N, timeout=30)
    try:
        errors = _agree_failing(gs, 2, CheckpointBusyError("busy: held by pid 7"), on_root=lambda s: "never")
        assert isinstance(errors[2], CheckpointBusyError) and str(errors[2]) == "busy: held by pid 7"
        for e in errors[:2]:
            assert type(e) is CheckpointBusyError
            assert str(e) == ("the save failed on rank 2 while preparing and locking the save: CheckpointBusyError: "
                              "busy: held by pid 7; nothing was written")
        errors = _agree_failing(gs, 1, OSError("disk full"))
        assert isinstance(errors[1], OSError)
        assert all(type(errors[r]) is CheckpointError and "failed on rank 1" in str(errors[r]) for r in (0, 2))
    finally:
        for g in gs:
            g.close()


def test_rank0s_commit_failure_reaches_every_rank_and_its_result_every_rank(groups):
    def one(g, commit):
        try:
            return agree(g, {"error": None, "files": {f"rank_{g.rank}": g.rank}}, None, "writing the data files",
                         on_root=commit, root_step="writing metadata.json")
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    assert on_threads(groups, one, lambda statuses: [s["files"] for s in statuses]) == \
        [[{f"rank_{r}": r} for r in range(N)]] * N

    def fail(statuses):
        raise OSError("read-only file system")

    errors = on_threads(groups, one, fail)
    assert isinstance(errors[0], OSError)
    for e in errors[1:]:
        assert type(e) is CheckpointError
        assert str(e) == ("the save failed on rank 0 while writing metadata.json: OSError: read-only file system; "
                          "this checkpoint is incomplete (metadata.json was not written)")


def test_agree_without_a_group_runs_the_commit_here():
    assert agree(None, {"error": None}, None, "x", on_root=lambda statuses: statuses) == [{"error": None}]
    with pytest.raises(ValueError, match="mine"):
        agree(None, {"error": "ValueError: mine"}, ValueError("mine"), "x", on_root=lambda s: 1 / 0)


def test_save_distributed_whose_commit_fails_on_rank0_fails_every_rank_and_commits_nothing(tmp_path, monkeypatch):
    import shardkit.checkpoint.saving.chunked_save as save_module   # the one engine save_distributed commits through

    def no_commit(*a, **k):
        raise OSError("no space left for metadata.json")

    monkeypatch.setattr(save_module, "commit", no_commit)
    spec = ShardMetadata(N, {"w": TensorShardSpec((6,), 0, (2, 2, 2))})
    gs = Group.local(N, timeout=30)

    def one(g):
        try:
            save_distributed({"w": torch.full((2,), float(g.rank)), "step": 1}, str(tmp_path / "ck"), g.rank, N, spec,
                             group=g)
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    try:
        errors = on_threads(gs, one)
    finally:
        for g in gs:
            g.close()
    assert isinstance(errors[0], OSError)
    assert all(type(e) is CheckpointError and "failed on rank 0 while writing metadata.json" in str(e)
               for e in errors[1:])
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert sorted(p.name for p in (tmp_path / "ck").glob("rank_*.safetensors")) == [f"rank_{r}.safetensors"
                                                                                    for r in range(N)]

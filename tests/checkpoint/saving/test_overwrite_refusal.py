"""Saving without a group into a directory that holds a checkpoint: refused unless ``overwrite=True``.

Without a group the ranks of a save cannot agree that they all replaced the
old checkpoint. A 3-rank checkpoint re-saved in place with the same plain
values (a resumed job saving the same step again), cut short after rank 0,
would validate and load rank 0's new bytes with ranks 1-2's old ones. These
tests pin down that such a save is refused before anything is touched, that
``overwrite=True`` does what its docstring says (caveat included), and that
saves with a group, or on one rank, still overwrite.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_helpers import save_full
from shardkit.checkpoint import (
    AsyncCheckpointer, ShardMetadata, TensorShardSpec, load_consolidated, load_distributed, save_distributed,
    validate_distributed,
)
from shardkit.errors import CheckpointError, CheckpointExistsError

WORLD = 3
SPEC = ShardMetadata(WORLD, {"w": TensorShardSpec((6, 2), 0, (2, 2, 2))})


def _rank_state(full: torch.Tensor, rank: int) -> dict:
    return {"w": full[2 * rank : 2 * rank + 2].clone(), "step": 100}   # same step: same plain values


def _save_ranks(directory, full, ranks, **kw) -> None:
    for rank in ranks:
        save_distributed(_rank_state(full, rank), directory, rank, WORLD, SPEC, **kw)


def _listing(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


OLD = torch.arange(12, dtype=torch.float32).reshape(6, 2)
NEW = -OLD - 1


def test_the_mixed_checkpoint_scenario_is_refused_up_front_and_the_old_one_still_loads(tmp_path):
    _save_ranks(tmp_path, OLD, range(WORLD))
    before = _listing(tmp_path)
    for rank in range(WORLD):                  # a resumed job re-saving the same step, every rank
        with pytest.raises(CheckpointExistsError) as refused:
            _save_ranks(tmp_path, NEW, [rank])
        message = str(refused.value)
        assert f"rank {rank} of 3" in message and "rank_%d.safetensors" % rank in message
        assert "new directory" in message and "group=" in message and "overwrite=True" in message
        assert "Nothing was written" in message
    assert isinstance(refused.value, FileExistsError) and isinstance(refused.value, CheckpointError)
    assert _listing(tmp_path) == before        # not a byte touched, no lock file left behind
    assert validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["w"], OLD)


def test_only_rank0_finishing_cannot_make_a_mix_any_more(tmp_path):
    _save_ranks(tmp_path, OLD, range(WORLD))
    with pytest.raises(CheckpointExistsError):
        _save_ranks(tmp_path, NEW, [0])        # "only rank 0 finishes": it does not even start
    assert validate_distributed(tmp_path).ok
    for rank in range(WORLD):
        assert torch.equal(load_distributed(tmp_path, rank, WORLD)["w"], OLD[2 * rank : 2 * rank + 2])


def test_ranks_of_one_save_never_refuse_each_other_whatever_their_order(tmp_path):
    # A fast rank's files of this save are not "an earlier save": rank 0 runs last here.
    _save_ranks(tmp_path / "a", OLD, [2, 1, 0])
    _save_ranks(tmp_path / "b", OLD, [0, 2, 1])
    for d in ("a", "b"):
        assert validate_distributed(tmp_path / d).ok
        assert torch.equal(load_consolidated(tmp_path / d)["w"], OLD)


def test_threads_as_ranks_of_one_save_all_succeed(tmp_path):
    errors = []

    def rank_main(rank):
        try:
            _save_ranks(tmp_path, OLD, [rank])
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and validate_distributed(tmp_path).ok


def test_overwrite_true_replaces_the_checkpoint_when_every_rank_finishes(tmp_path):
    _save_ranks(tmp_path, OLD, range(WORLD))
    _save_ranks(tmp_path, NEW, range(WORLD), overwrite=True)
    assert validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["w"], NEW)


def test_overwrite_true_has_exactly_the_documented_caveat(tmp_path):
    """With the same plain values and only rank 0 finishing, the directory loads a mix: what the refusal prevents."""
    _save_ranks(tmp_path, OLD, range(WORLD))
    _save_ranks(tmp_path, NEW, [0], overwrite=True)
    mixed = load_consolidated(tmp_path)["w"]
    assert validate_distributed(tmp_path).ok
    assert torch.equal(mixed[:2], NEW[:2]) and torch.equal(mixed[2:], OLD[2:])


def test_overwrite_true_with_a_changed_step_never_completes_with_old_rank_files(tmp_path):
    _save_ranks(tmp_path, OLD, range(WORLD))
    save_distributed({"w": NEW[:2].clone(), "step": 200}, tmp_path, 0, WORLD, SPEC, overwrite=True)
    assert not validate_distributed(tmp_path).ok    # save_id differs: ranks 1-2's old manifests do not count


def test_leftovers_of_an_unfinished_save_are_refused_too(tmp_path):
    _save_ranks(tmp_path, OLD, [1])                 # rank 1 of an earlier save that never committed
    _save_ranks(tmp_path, NEW, [0, 2])              # their own files are not there: allowed
    with pytest.raises(CheckpointExistsError, match="rank_1"):
        _save_ranks(tmp_path, NEW, [1])


@pytest.mark.parametrize("launcher", [{"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": ("0", "1")},
                                      {"SLURM_JOB_ID": ("41", "42")}], ids=["torchrun-restart", "slurm-requeue"])
def test_a_restarted_job_never_completes_a_step_with_its_killed_attempts_files(tmp_path, monkeypatch, launcher):
    """The same step, the same plain values: only the launcher's attempt tells the two saves apart."""
    def attempt(i):
        for name, value in launcher.items():
            monkeypatch.setenv(name, value if isinstance(value, str) else value[i])

    attempt(0)
    _save_ranks(tmp_path, OLD, [1])                 # the killed attempt got as far as rank 1's files
    attempt(1)
    _save_ranks(tmp_path, NEW, [0, 2])              # the restart saves the step again; rank 1 refuses
    with pytest.raises(CheckpointExistsError, match="rank_1"):
        _save_ranks(tmp_path, NEW, [1])
    assert not validate_distributed(tmp_path).ok    # before: "ok", and loads mixed OLD's rows 2-3 in
    with pytest.raises(CheckpointError):
        load_consolidated(tmp_path)


def test_one_rank_alone_may_overwrite_without_asking(tmp_path):
    """world_size == 1: no other rank to disagree with; a cut-short re-save reads as incomplete, never mixed."""
    save_full({"w": torch.zeros(4)}, tmp_path, 1, {"w": 0})
    save_full({"w": torch.ones(4)}, tmp_path, 1, {"w": 0})
    assert validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.ones(4))


def _in_threads(fn, groups):
    errors, threads = [], []

    def run(g):
        try:
            fn(g)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def test_group_saves_still_overwrite(tmp_path):
    from shardkit.comm import Group

    _save_ranks(tmp_path, OLD, range(WORLD))
    groups = Group.local(WORLD)
    try:
        _in_threads(lambda g: save_distributed(_rank_state(NEW, g.rank), tmp_path, g.rank, WORLD, SPEC, group=g),
                    groups)
    finally:
        for g in groups:
            g.close()
    assert validate_distributed(tmp_path).ok
    assert torch.equal(load_consolidated(tmp_path)["w"], NEW)


def test_async_checkpointer_without_a_group_refuses_at_save_async_and_takes_overwrite(tmp_path):
    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    ckpts = [AsyncCheckpointer(tmp_path, r, 2, spec) for r in range(2)]
    for r, c in enumerate(ckpts):
        c.save_async({"w": torch.full((2,), 1.0 + r)}).wait()
    for c in ckpts:                              # the default dir again: refused here, nothing staged
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            c.save_async({"w": torch.zeros(2)})
    for r, c in enumerate(ckpts):                # asked for, per save
        c.save_async({"w": torch.full((2,), 5.0 + r)}, overwrite=True).wait()
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.tensor([5.0, 5.0, 6.0, 6.0]))
    for c in ckpts:
        c.close()
    for r in range(2):                           # or once, for every save of a checkpointer
        with AsyncCheckpointer(tmp_path, r, 2, spec, overwrite=True) as c:
            c.save_async({"w": torch.full((2,), 7.0)}).wait()
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.full((4,), 7.0))
    assert validate_distributed(tmp_path).ok


def test_async_checkpointer_with_a_group_resaves_its_default_dir(tmp_path):
    from shardkit.comm import Group

    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    groups = Group.local(2)

    def save_twice(g):
        with AsyncCheckpointer(tmp_path, g.rank, 2, spec, group=g) as ckpt:
            for value in (1.0, 2.0):
                ckpt.save_async({"w": torch.full((2,), value)}).wait(timeout=60)

    try:
        _in_threads(save_twice, groups)
    finally:
        for g in groups:
            g.close()
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.full((4,), 2.0))

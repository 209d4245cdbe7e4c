"""Crash safety (``docs/format.md``, invariants 1-3): a save killed with SIGKILL at many points.

Each case forks a child (``crash_child.py``) that saves a checkpoint and
SIGKILLs itself at one point of the save: in the middle of a data file, with
a data file written but not renamed, between a data file and its manifest,
between the manifests and ``metadata.json``, in the middle of
``metadata.json``; on 1 rank and on 2 ranks saving without a group; into a
fresh directory and over an existing complete checkpoint. The children run
in parallel from a forkserver that imported torch once, so the whole module
takes a few seconds.

Then, for every case: the earlier checkpoints elsewhere still validate and
load bit for bit; a fresh directory is reported incomplete by
``validate_distributed`` and refuses to load with
``IncompleteCheckpointError`` / ``MissingShardError``; an overwritten
directory is either reported incomplete, or complete and holding exactly the
old or exactly the new state, never a mixture.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import signal

import pytest
import torch

import crash_child
from state_leaves import leaves
from crash_child import make_state, spec
from shardkit.checkpoint import load_distributed, save_distributed, validate_distributed
from shardkit.checkpoint.background.checkpointer import AsyncCheckpointer
from shardkit.errors import CheckpointError, IncompleteCheckpointError, MissingShardError

#: (case id, world size, kill point) -- see crash_child for the kill points.
CASES = [
    ("first-byte", 1, {"at": "bytes", "file": None, "n": 1}),
    ("mid-header", 1, {"at": "bytes", "file": "rank_0.safetensors", "n": 100}),
    ("mid-data", 1, {"at": "bytes", "file": "rank_0.safetensors", "n": 40_000}),
    ("data-not-renamed", 1, {"at": "before_publish", "file": "rank_0.safetensors"}),
    ("between-data-and-manifest", 1, {"at": "after_publish", "file": "rank_0.safetensors"}),
    ("between-manifest-and-metadata", 1, {"at": "after_publish", "file": "rank_0.json"}),
    ("mid-metadata", 1, {"at": "bytes", "file": "metadata.json", "n": 40}),
    ("metadata-not-renamed", 1, {"at": "before_publish", "file": "metadata.json"}),
    ("rank1-mid-data", 2, {"at": "bytes", "file": "rank_1.safetensors", "n": 5_000}),
    ("rank1-data-not-renamed", 2, {"at": "before_publish", "file": "rank_1.safetensors"}),
    ("rank1-between-data-and-manifest", 2, {"at": "after_publish", "file": "rank_1.safetensors"}),
    # Without a group rank 0 finishes alone (format 2: its rank_0.json is its last file; the last rank to
    # finish commits); rank 1 dies before it starts (before withdrawing its old manifest).
    ("rank0-committed-rank1-not-started", 2, {"at": "after_publish", "file": "rank_0.json"}),
    # Both ranks wrote their files; the last one dies just before publishing metadata.json.
    ("last-rank-metadata-not-renamed", 2, {"at": "before_publish", "file": "metadata.json"}),
    # ... and the other way round: rank 1 finished first, rank 0 dies before withdrawing the old metadata.
    ("rank1-done-rank0-not-started", 2, {"at": "after_publish", "file": "rank_1.json", "ranks": [1, 0]}),
]
MODES = ("fresh", "overwrite")
ASYNC_CASE = ("async-mid-data", 1, {"at": "bytes", "file": "rank_0.safetensors", "n": 30_000})

INCOMPLETE = re.compile(r"incomplete|missing|never finished|does not exist|no metadata", re.I)


def _async_save_and_die(directory, which, kill):
    torch.set_num_threads(1)
    crash_child.install_kill_hooks(kill)
    with AsyncCheckpointer(directory, 0, 1, spec(1)) as ckpt:
        ckpt.save_async(make_state(which)).wait()
    os._exit(3)


def _save_complete(directory, which, world_size):
    for rank in range(world_size):
        save_distributed(make_state(which, rank, world_size), directory, rank, world_size, spec(world_size))


def _same(loaded, expected) -> bool:
    a, b = leaves(loaded), leaves(expected)
    if a.keys() != b.keys():
        return False
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            w = a[k]
            if not isinstance(w, torch.Tensor) or w.dtype != v.dtype or w.shape != v.shape:
                return False
            if not torch.equal(w.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)):
                return False
        elif a[k] != v:
            return False
    return True


def _loads_as(directory, world_size, which) -> bool:
    return all(
        _same(load_distributed(directory, r, world_size), make_state(which, r, world_size))
        for r in range(world_size)
    )


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run every case once; return {(case, mode): (dir, world, exit code)} and the earlier checkpoints."""
    root = tmp_path_factory.mktemp("crash")
    earlier = {}
    for world in (1, 2):
        earlier[world] = str(root / f"earlier-w{world}")
        _save_complete(earlier[world], "old", world)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardkit.checkpoint", "crash_child"])
    jobs = {}
    for case, world, kill in CASES + [ASYNC_CASE]:
        for mode in MODES:
            d = str(root / f"{case}-{mode}")
            if mode == "overwrite":
                shutil.copytree(earlier[world], d)
            if case == ASYNC_CASE[0]:
                p = ctx.Process(target=_async_save_and_die, args=(d, "new", kill))
            else:
                p = ctx.Process(target=crash_child.save_and_die, args=(d, "new", kill, world))
            p.start()
            jobs[(case, mode)] = (p, d, world)
    out = {}
    for key, (p, d, world) in jobs.items():
        p.join(60)
        if p.is_alive():
            p.kill()
        out[key] = (d, world, p.exitcode)
    return out, earlier


ALL_IDS = [c[0] for c in CASES] + [ASYNC_CASE[0]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ALL_IDS)
def test_child_was_killed_at_the_point(crashed, case, mode):
    d, world, code = crashed[0][(case, mode)]
    assert code == -signal.SIGKILL, (
        f"{case}/{mode}: the child exited with {code}; 3 means the save finished without reaching the "
        f"kill point (did the write path stop using storage.atomic_writer / os.replace?)")


def test_earlier_checkpoints_are_intact_bit_for_bit(crashed):
    for world, d in crashed[1].items():
        report = validate_distributed(d)
        assert report.ok, report.problems
        assert _loads_as(d, world, "old")


@pytest.mark.parametrize("case", ALL_IDS)
def test_interrupted_save_is_reported_incomplete_and_refuses_to_load(crashed, case):
    d, world, _ = crashed[0][(case, "fresh")]
    report = validate_distributed(d)
    assert not report.ok, f"{case}: an interrupted save validates as complete"
    text = " ".join(report.problems)
    assert INCOMPLETE.search(text), f"{case}: problems do not say incomplete/missing: {report.problems}"
    for load_world in sorted({world, 1}):
        with pytest.raises((IncompleteCheckpointError, MissingShardError)) as info:
            load_distributed(d, 0, load_world)
        msg = str(info.value)
        assert INCOMPLETE.search(msg) and (d in msg or os.path.basename(d) in msg), f"{case}: unhelpful: {msg}"


# Without a group, rank manifests carry the save's id (layout + plain values), so a stale
# rank_<r>.json from the previous save no longer completes a new metadata.json.
@pytest.mark.parametrize("case", ALL_IDS)
def test_interrupted_overwrite_is_never_complete_with_wrong_data(crashed, case):
    d, world, _ = crashed[0][(case, "overwrite")]
    report = validate_distributed(d)
    if not report.ok:
        for load_world in sorted({world, 1}):
            with pytest.raises(CheckpointError):
                load_distributed(d, 0, load_world)
        return
    # Reported complete: it must be wholly the old state or wholly the new one, on any world size.
    for load_world in sorted({world, 1, 3}):
        old, new = _loads_as(d, load_world, "old"), _loads_as(d, load_world, "new")
        assert old or new, f"{case}: validates as complete but holds a mixture of the old and the new save"

"""Crash safety of incremental saves: a save against a base, SIGKILLed at many points.

Steps 0 (full) and 1 (incremental, base 0) are saved complete; then a child
saves step 2 against step 1 and kills itself in the middle of its data file,
before or after publishing it, in the middle of ``metadata.json`` or before
publishing it; another child does the same through
``CheckpointManager(incremental=True, keep_last=1)``. Afterwards: steps 0 and
1 validate and load bit for bit, step 2 is reported incomplete and refuses to
load, and a manager restores step 1 and saves on (the base chain intact).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil

import pytest
import torch

import incremental_crash_child as child
import shardkit.checkpoint as ck
from shardkit.checkpoint import CheckpointManager, validate_distributed
from shardkit.errors import CheckpointError

KILLS = [
    ("first-byte", {"at": "bytes", "file": None, "n": 1}),
    ("mid-data", {"at": "bytes", "file": "rank_0.safetensors", "n": 3000}),
    ("data-not-renamed", {"at": "before_publish", "file": "rank_0.safetensors"}),
    ("data-published", {"at": "after_publish", "file": "rank_0.safetensors"}),
    ("mid-metadata", {"at": "bytes", "file": "metadata.json", "n": 40}),
    ("metadata-not-renamed", {"at": "before_publish", "file": "metadata.json"}),
]
MODES = ("save", "manager")
INCOMPLETE = re.compile(r"incomplete|missing|never finished|does not exist|no metadata|not a checkpoint", re.I)


def _empty() -> dict:
    return {"frozen": torch.empty(64, 256), "adapter": torch.empty(8, 256), "step": None}


def _loads_as(directory: str, step: int) -> bool:
    out = _empty()
    ck.load(out, directory)
    expected = child.make_state(step)
    return out["step"] == step and all(torch.equal(out[k].view(torch.uint8), expected[k].view(torch.uint8))
                                       for k in ("frozen", "adapter"))


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    root = tmp_path_factory.mktemp("inc-crash")
    template = root / "template"
    with CheckpointManager(str(template), keep_last=5, incremental=True, async_save=False) as mgr:
        for step in (0, 1):
            mgr.save(step, child.make_state(step))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardkit.checkpoint", "crash_child", "incremental_crash_child"])
    jobs = {}
    for case, kill in KILLS:
        for mode in MODES:
            run = root / f"{case}-{mode}"
            shutil.copytree(template, run)
            if mode == "save":
                args = (child.save_and_die, (str(run / "step-2"), str(run / "step-1"), 2, kill))
            else:
                args = (child.manager_save_and_die, (str(run), 2, kill))
            p = ctx.Process(target=args[0], args=args[1])
            p.start()
            jobs[(case, mode)] = (p, str(run))
    out = {}
    for key, (p, run) in jobs.items():
        p.join(120)
        if p.is_alive():
            p.kill()
        out[key] = (run, p.exitcode)
    return out


CASES = [(case, mode) for case, _ in KILLS for mode in MODES]


@pytest.mark.parametrize("case, mode", CASES)
def test_the_child_was_killed(crashed, case, mode):
    assert crashed[(case, mode)][1] == -9, f"{case}/{mode}: exit code {crashed[(case, mode)][1]} (3: never reached)"


@pytest.mark.parametrize("case, mode", CASES)
def test_base_chain_stays_loadable_and_the_crashed_step_is_incomplete(crashed, case, mode):
    run, _ = crashed[(case, mode)]
    assert "bases" in open(os.path.join(run, "step-1", "metadata.json")).read()   # step 1 does reference 0
    for step in (0, 1):
        assert validate_distributed(os.path.join(run, f"step-{step}")).ok
        assert _loads_as(os.path.join(run, f"step-{step}"), step)
    report = validate_distributed(os.path.join(run, "step-2"))
    assert not report.ok and any(INCOMPLETE.search(p) for p in report.problems), report
    with pytest.raises(CheckpointError, match=INCOMPLETE):
        ck.load(_empty(), os.path.join(run, "step-2"))


@pytest.mark.parametrize("case", [c for c, _ in KILLS])
def test_a_manager_restores_the_last_complete_step_and_saves_on(crashed, case):
    run, _ = crashed[(case, "manager")]
    with CheckpointManager(run, keep_last=1, incremental=True, async_save=False) as mgr:
        assert mgr.steps() == [0, 1]
        out = _empty()
        assert mgr.restore(out) == 1 and torch.equal(out["adapter"], child.make_state(1)["adapter"])
        mgr.save(2, child.make_state(2))
        mgr.wait()
        assert mgr.steps() == [0, 2]        # step 1 freed, step 0 kept: step 2 references it
        assert _loads_as(mgr.step_dir(2), 2)

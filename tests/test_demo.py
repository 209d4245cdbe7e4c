"""``shardkit demo`` end to end (one subprocess run: slow, kept in the default run), and its pure helpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardkit.demo.report import Summary, first_mismatch, step_dirs, steps_text

HANG_GUARD_S = 290  # a hang guard under pytest-timeout's 300 s, not a timing


@pytest.mark.slow
@pytest.mark.multiproc
def test_demo_end_to_end_passes_every_check_and_keeps_its_outputs(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", "demo", str(out)], capture_output=True,
                          text=True, timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "demo: every check passed"
    for check in ("crash-detected", "losses-4-ranks", "resumed-from-complete", "resumed-losses",
                  "hf-weights", "hf-logits"):
        assert any(line.startswith(f"  ok   {check}:") for line in lines), (check, proc.stdout)
    for phase in ("reference", "train", "resume", "export", "total"):
        assert any(line.startswith(f"  {phase} ") for line in lines), (phase, proc.stdout)
    assert "step-12 (incomplete: ignored)" in proc.stdout
    assert "restored step 8 on 2 ranks" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "it/s" not in proc.stdout + proc.stderr                 # no progress bar when not a terminal
    assert sorted(os.listdir(out / "checkpoints")) == ["step-20", "step-24"]         # keep_last=2
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors.index.json").is_file()


# --- pure helpers -------------------------------------------------------------------------------------

def test_first_mismatch_is_bit_for_bit_and_names_the_step():
    reference = [3.0, 2.5, 2.25, 2.0]
    assert first_mismatch({2: 2.25, 3: 2.0}, reference) is None
    assert first_mismatch({}, reference) is None
    assert first_mismatch({1: 2.5, 2: 2.25 + 2**-40}, reference) == (2, 2.25 + 2**-40, 2.25)
    assert first_mismatch({4: 1.0}, reference) == (4, 1.0, None)            # a step the reference lacks
    assert first_mismatch({0: float("nan")}, [float("nan")])[0] == 0        # NaN never equals


def test_steps_text_compresses_runs():
    assert steps_text([]) == "none"
    assert steps_text([5]) == "5"
    assert steps_text([0, 1, 2, 3]) == "0-3"
    assert steps_text([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_step_dirs_orders_by_step_number_not_by_name(tmp_path):
    for name in ("step-12", "step-4", "step-8", "step-x", "other", "step-"):
        (tmp_path / name).mkdir()
    assert step_dirs(str(tmp_path)) == ["step-4", "step-8", "step-12"]


def test_summary_names_the_failed_checks():
    s = Summary()
    s.phase("train", "4 ranks", 1.25)
    assert s.check("a", True, "fine") is True
    assert s.check("hf-logits", False, "logits differ") is False
    lines = s.lines(2.0)
    assert "  train        1.2 s  4 ranks" in lines and "  total        2.0 s" in lines
    assert "  FAIL hf-logits: logits differ" in lines and "  ok   a: fine" in lines
    assert lines[-1] == "demo: FAILED check(s): hf-logits"
    ok = Summary()
    ok.check("a", True, "fine")
    assert ok.lines(1.0)[-1] == "demo: every check passed"

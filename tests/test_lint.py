"""Pyflakes' checks (ruff's ``F`` rules) over the code: an undefined name is a crash on the one path no
test here takes (a CUDA tensor's staging was one), and an unused import hides a layer arrow."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_undefined_names_unused_imports_or_unused_variables():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", "--output-format",
                           "concise", "src", "tests", "examples"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff found problems (fix them, or `ruff check --select F --fix`):\n{done.stdout}"

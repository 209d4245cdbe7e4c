"""Every code block in the README runs, as written: a new user copies them first.

Python blocks run in order, each as a script, in one fresh directory (a later
block may use the files an earlier one wrote, as a reader following along
would). A block whose first line is ``# run: <command>`` (for example
``# run: torchrun --nproc-per-node 4 train.py``) is saved under the file name
that command names and run with exactly that command; any other block runs
with ``python`` (in a child forked from one warm interpreter, ``warm_python.py``: each block still
runs whole, as ``__main__``, in a process of its own, without paying torch's import again). The
``shardkit ...`` and ``torchrun ...`` lines of ``sh``
blocks run afterwards in the same directory (which sees the repository's
``examples/``), except ``shardkit demo`` and ``shardkit bench`` (tested on
their own) and ``make`` (which is what CI runs); the two ``examples/train.py``
runs are then checked against an uninterrupted run, as the README says they
match. Last, the output the README
shows (``text`` blocks of ``$ shardkit ...`` lines, each followed by what it
prints) is produced again from a copy of ``ckpt/`` (by the ``shardkit`` entry point in a warm child)
and compared line by line, timings aside.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from warm_python import WarmPython

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
_SKIPPED_COMMANDS = ("shardkit demo", "shardkit bench")


def readme_blocks(path: str = os.path.join(ROOT, "README.md")) -> list[tuple[str, str]]:
    """``(language, code)`` for each fenced block of the README, in order."""
    with open(path, encoding="utf-8") as f:
        return [(lang, code) for lang, code in _FENCE.findall(f.read())]


def _command_for(code: str, index: int) -> tuple[str, list[str]]:
    """The file name a block is saved as, and the command that runs it."""
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith("# run:"):
        argv = shlex.split(first[len("# run:"):])
        script = next(a for a in argv if a.endswith(".py"))
        launcher = os.path.join(BIN, argv[0]) if os.path.exists(os.path.join(BIN, argv[0])) else argv[0]
        return script, [launcher, *argv[1:]]
    script = f"readme_block_{index}.py"
    return script, [sys.executable, script]


def _shown_commands(code: str) -> list[tuple[str, list[str]]]:
    """``(command, printed lines)`` for each ``$ ...`` line of a shown-output block."""
    shown: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            shown.append((line[2:], []))
        elif shown:
            shown[-1][1].append(line)
    return shown


def _timings_aside(lines: list[str]) -> list[str]:
    return [re.sub(r"\b\d+\.\d+ s\b", "<t> s", line.rstrip()) for line in lines]


_ENV = {"PATH": BIN + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1"}


def _run(argv: list[str], cwd, what: str, warm: WarmPython | None = None) -> str:
    """Run ``argv`` in ``cwd`` (a ``python`` script in a child of ``warm`` when given); fail the test unless
    it exits 0; return what it printed."""
    if warm is not None and argv[0] == sys.executable:
        code, out, err = warm.run(argv[1:], cwd, _ENV)
    else:
        done = subprocess.run(argv, cwd=cwd, env={**os.environ, **_ENV}, capture_output=True, text=True,
                              timeout=240)
        code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 0, f"{what} failed ({code}):\n{out[-4000:]}\n{err[-4000:]}"
    return out


def _losses(printed: str) -> dict[int, str]:
    """``{step: loss as printed}`` from ``examples/train.py``'s ``step N loss X (...)`` lines."""
    return {int(line.split()[1]): line.split()[3] for line in printed.splitlines() if line.startswith("step ")}


def _check_train_resume(printed: list[str], cwd) -> None:
    """The README's claim about ``examples/train.py``: the run cut at step 6 and resumed on another
    number of processes prints the losses an uninterrupted run prints, digit for digit."""
    first, resumed = (_losses(p) for p in printed)
    reference = _losses(_run([os.path.join(BIN, "torchrun"), "--nproc-per-node", "1", "examples/train.py",
                              "uninterrupted", "10"], cwd, "the uninterrupted train.py run"))
    assert sorted(first) == list(range(6)) and sorted(resumed) == list(range(6, 10))
    assert {**first, **resumed} == reference
    assert sorted(os.listdir(os.path.join(cwd, "ckpt-run"))) == ["step-10", "step-8"]    # keep_last=2


def test_readme_has_blocks():
    languages = {lang for lang, _ in readme_blocks()}
    assert {"python", "sh"} <= languages


@pytest.mark.slow
def test_every_readme_block_runs_as_written(tmp_path):
    with WarmPython(_ENV) as warm:
        _every_block_runs_as_written(tmp_path, warm)


def _every_block_runs_as_written(tmp_path, warm: WarmPython) -> None:
    blocks = readme_blocks()
    for index, (lang, code) in enumerate(blocks):
        if lang != "python":
            continue
        script, argv = _command_for(code, index)
        (tmp_path / script).write_text(code, encoding="utf-8")
        _run(argv, tmp_path, f"README python block {index} ({' '.join(argv[-2:])})", warm)
    (tmp_path / "examples").symlink_to(os.path.join(ROOT, "examples"))
    train_printed = []
    for index, (lang, code) in enumerate(blocks):
        if lang != "sh":
            continue
        for line in code.splitlines():
            command = line.split("#", 1)[0].strip()
            if command.startswith(("shardkit ", "torchrun ")) and not command.startswith(_SKIPPED_COMMANDS):
                argv = shlex.split(command)
                printed = _run([os.path.join(BIN, argv[0]), *argv[1:]], tmp_path, f"README sh block {index}: {command}")
                if "examples/train.py" in argv:
                    train_printed.append(printed)
    _check_train_resume(train_printed, tmp_path)
    shown_dir = tmp_path / "shown"
    shutil.copytree(tmp_path / "ckpt", shown_dir / "ckpt")
    for lang, code in blocks:
        for command, printed in _shown_commands(code) if lang == "text" else []:
            argv = shlex.split(command)
            if argv[0] == "shardkit":
                code, out, err = warm.run(argv, shown_dir, _ENV, command=True)
            else:
                done = subprocess.run([os.path.join(BIN, argv[0]), *argv[1:]], cwd=shown_dir, capture_output=True,
                                      text=True, timeout=240)
                code, out, err = done.returncode, done.stdout, done.stderr
            assert code == 0, f"{command}: {err[-2000:]}"
            assert _timings_aside(out.splitlines()) == _timings_aside(printed), command

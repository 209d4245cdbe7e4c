"""The ``shardkit`` command on bad input: one line on stderr, the right exit code, never a traceback.

Every subcommand runs in a real subprocess (``python -m shardkit.cli``), so an
uncaught exception or an interpreter-exit ``BrokenPipeError`` would show.
Exit codes: 0 ok, 1 a bad checkpoint, 2 bad usage or input, 3 internal error.
"""

import contextlib
import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from shardkit.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD_S = 180  # a hang guard, not a timing


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shardkit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=GUARD_S, cwd=ROOT, env={**os.environ, **(env or {})})


def _in_process(*args):
    """The same call through ``main`` in this process (no interpreter start: for the long case list)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _assert_one_line_error(proc, code, command):
    assert proc.returncode == code, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"shardkit {command}: error: ")


# --- building the inputs (cheap: no model, at most a few small files) --------------------------------

def _distributed(d):
    from shardkit.checkpoint import save_distributed

    save_distributed({"w": torch.arange(4.0), "step": 3}, str(d), 0, 1, None)
    return d


def _hf(d):
    from shardkit.hf import save_checkpoint

    save_checkpoint(str(d), {"a": torch.zeros(3), "b": torch.ones(2, 2)}, safetensors=True, max_shard_size=12)
    return d


def _many_ranks(d, num_ranks=5000, num_tensors=3000):
    """A manifest that parses but names 5,000 ranks and no files (and 3,000 tensors: long inspect output)."""
    d.mkdir()
    specs = {f"t{i}": {"full_shape": [4], "shard_dim": None, "shard_sizes": [], "dtype": "F32", "owner_rank": 0}
             for i in range(num_tensors)}
    (d / "metadata.json").write_text(json.dumps({
        "format": "shardkit.distributed", "format_version": 1, "num_ranks": num_ranks, "tensor_specs": specs,
        "files": {}, "objects": {}, "structure": {"dict": [[name, "T"] for name in specs]}, "user_metadata": {}}))
    return d


def _make(kind, tmp_path):
    d = tmp_path / kind
    if kind == "missing":
        return d
    if kind == "a-file":
        d.write_bytes(b"not a directory")
        return d
    if kind == "not-a-checkpoint":
        d.mkdir()
        (d / "notes.txt").write_text("hello")
        return d
    if kind == "corrupt-distributed":
        _distributed(d)
        (d / "metadata.json").write_text('{"format": "shardkit.distributed", "num_ranks": ')
    elif kind == "hostile-distributed":
        _distributed(d)
        (d / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "corrupt-hf-index":
        _hf(d)
        (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    elif kind == "corrupt-hf-shard":
        _hf(d)
        header = json.dumps({"a": {"dtype": ["F32"], "shape": [3], "data_offsets": [0, 12]}}).encode()
        (d / "model-00001-of-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    elif kind == "incomplete-distributed":
        _distributed(d)
        (d / "metadata.json").unlink()
    elif kind == "incomplete-hf":
        _hf(d)
        (d / "model-00002-of-00002.safetensors").unlink()
    elif kind == "fifo-distributed":
        _distributed(d)
        (d / "rank_0.safetensors").unlink()
        os.mkfifo(d / "rank_0.safetensors")
    elif kind == "fifo-hf":
        _hf(d)
        (d / "model.safetensors.index.json").unlink()
        os.mkfifo(d / "model.safetensors.index.json")
    return d


# (input, exit code of inspect, exit code of validate)
CASES = [
    ("missing", 2, 2),
    ("a-file", 2, 2),
    ("not-a-checkpoint", 2, 2),
    ("corrupt-distributed", 1, 1),
    ("hostile-distributed", 1, 1),
    ("corrupt-hf-index", 1, 1),
    ("corrupt-hf-shard", 1, 1),
    ("incomplete-distributed", 1, 1),
    ("incomplete-hf", 1, 1),
    ("fifo-distributed", 2, 2),
    ("fifo-hf", 2, 2),
]


#: Cases also run in a real subprocess (each costs an interpreter and a torch import): the ones
#: that never import torch, and one per exit code that does.
IN_SUBPROCESS = {"missing", "a-file", "not-a-checkpoint", "fifo-distributed", "fifo-hf", "corrupt-hf-shard",
                 "incomplete-distributed"}


@pytest.mark.parametrize("kind,inspect_code,validate_code", CASES, ids=[c[0] for c in CASES])
def test_inspect_and_validate_on_bad_input(tmp_path, kind, inspect_code, validate_code):
    d = _make(kind, tmp_path)
    runners = [_in_process, _cli] if kind in IN_SUBPROCESS else [_in_process]
    for run in runners:
        _check_case(run, d, inspect_code, validate_code)


def _check_case(run, d, inspect_code, validate_code):
    _assert_one_line_error(run("inspect", d), inspect_code, "inspect")
    proc = run("validate", d)
    if validate_code == 1 and proc.returncode == 1 and not proc.stderr:
        # validation ran and found problems: a summary on stdout, nothing on stderr
        assert "problem(s)" in proc.stdout and "Traceback" not in proc.stdout
    else:
        _assert_one_line_error(proc, validate_code, "validate")


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_inspect_of_a_checkpoint_missing_a_rank_file_says_so_and_exits_1(tmp_path, damage):
    from shardkit.checkpoint import save_distributed

    for rank in (1, 0):
        save_distributed({"w": torch.arange(4.0) + rank}, str(tmp_path), rank, 2, None)
    data = tmp_path / "rank_1.safetensors"
    data.unlink() if damage == "missing" else data.write_bytes(data.read_bytes()[:-4])
    proc = _in_process("inspect", tmp_path)
    assert proc.returncode == 1 and "NOT COMPLETE" in proc.stdout and "rank_1" in proc.stdout, proc.stdout
    proc = _in_process("inspect", tmp_path, "--json")
    assert proc.returncode == 1 and any("rank_1" in p for p in json.loads(proc.stdout)["problems"])


def test_inspect_of_a_lone_pytorch_model_bin_gives_dtypes_and_sizes(tmp_path):
    torch.save({"a": torch.zeros(3), "b": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "pytorch_model.bin")
    proc = _in_process("inspect", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: (r["dtype"], r["bytes"]) for r in json.loads(proc.stdout)["tensors"]}
    assert rows == {"a": ("F32", 12), "b": ("BF16", 8)}
    assert "unknown size" not in _in_process("inspect", tmp_path).stdout


def test_inspect_and_validate_work_on_hugging_face_checkpoints(tmp_path):
    d = _hf(tmp_path / "hf")
    proc = _cli("inspect", d, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["format"] == "huggingface"
    assert {r["name"]: r["shape"] for r in summary["tensors"]} == {"a": [3], "b": [2, 2]}
    proc = _in_process("validate", d)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{d}: ok", proc.stderr


def test_validate_summarises_a_long_problem_list(tmp_path, monkeypatch):
    # validate_distributed itself condenses a run of missing files; the CLI must still
    # summarise any long list it is given, so feed it one of 5,001 distinct problems.
    import shardkit.checkpoint
    from shardkit.checkpoint.loading.validate import ValidationReport

    d = _many_ranks(tmp_path / "r5k")
    problems = [f"rank_{r}.safetensors is damaged (problem {r})" for r in range(5001)]
    monkeypatch.setattr(shardkit.checkpoint, "validate_distributed", lambda path, **kwargs: ValidationReport(path, problems))
    proc = _in_process("validate", d)
    assert proc.returncode == 1 and not proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{d}: 5001 problem(s)"
    assert len(lines) == 1 + 20 + 1
    assert lines[-1] == "  ... and 4981 more (use --all or --json)"
    proc = _in_process("validate", "--all", d)
    assert proc.returncode == 1 and len(proc.stdout.splitlines()) == 5002
    proc = _in_process("validate", "--json", d)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["path"] == str(d) and report["ok"] is False and len(report["problems"]) == 5001


def test_validate_condenses_thousands_of_missing_files(tmp_path):
    d = _many_ranks(tmp_path / "r5k")
    proc = _cli("validate", d)
    assert proc.returncode == 1 and not proc.stderr
    assert "4995 more of the 5000 data files are missing" in proc.stdout
    assert len(proc.stdout.splitlines()) < 25


@pytest.mark.parametrize("args", [["inspect"]])
def test_broken_pipe_is_quiet(tmp_path, args):
    d = _many_ranks(tmp_path / "r5k")
    proc = subprocess.Popen([sys.executable, "-m", "shardkit.cli", *args, str(d)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.readline()  # like `| head -1`: read a line, then go away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=GUARD_S) == 141, err
    assert err == ""


# --- demo and bench -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["a-file", "fifo", "not-empty", "missing-parent"])
def test_demo_refuses_a_bad_target(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "a-file":
        target.write_text("x")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "not-empty":
        target.mkdir()
        (target / "old").write_text("x")
    else:
        target = tmp_path / "no" / "such" / "target"
    _assert_one_line_error(_cli("demo", target), 2, "demo")


def test_bench_refuses_a_missing_workdir(tmp_path):
    _assert_one_line_error(_cli("bench", "--workdir", tmp_path / "missing"), 2, "bench")
    # ``python -m shardkit.bench`` too: argparse's usage and the same reason, no traceback
    proc = subprocess.run([sys.executable, "-m", "shardkit.bench", "--workdir", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not an existing directory" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["inspect", "validate", "demo"])
def test_every_subcommand_help_is_useful(command):
    proc = _cli(command, "--help")  # argparse exits before any subcommand imports torch: cheap
    assert proc.returncode == 0 and "usage:" in proc.stdout
    assert {"inspect": "Hugging", "validate": "--all", "demo": "ranks"}[command] in proc.stdout
    top = _cli("--help")
    assert "exit codes" in top.stdout and "SHARDKIT_DEBUG" in top.stdout


def test_bad_usage_exits_2_without_traceback():
    proc = _cli("validate")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "usage:" in proc.stderr
    proc = _cli("frobnicate")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


# --- an unexpected internal error: one line and a hint; the traceback only on request -----------------

def test_internal_error_is_one_line_with_a_hint(tmp_path, monkeypatch, capsys):
    import shardkit.cli.validate as validate_cmd

    def broken(path, progress=None):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(validate_cmd, "problems_of", broken)
    monkeypatch.delenv("SHARDKIT_DEBUG", raising=False)
    assert cli_main(["validate", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: something inside broke" in err and "SHARDKIT_DEBUG=1" in err
    assert "Traceback" not in err
    monkeypatch.setenv("SHARDKIT_DEBUG", "1")
    assert cli_main(["validate", str(tmp_path)]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_inspect_summarises_long_plain_values():
    from shardkit.cli.inspect_cmd import MAX_VALUE_CHARS, MAX_VALUES_SHOWN, summarise_values

    values = {f"optim.param_groups.{i}.lr": 0.1 for i in range(40)}
    values["note"] = "x" * 1000
    lines = summarise_values(values)
    assert len(lines) == MAX_VALUES_SHOWN + 1 and lines[-1] == f"... and {41 - MAX_VALUES_SHOWN} more (--json shows every value)"
    assert all(len(line) <= MAX_VALUE_CHARS + 40 for line in lines)

"""One table of exit codes for every subcommand, and ``--json`` that JSON parsers accept."""

from __future__ import annotations

import io
import subprocess
import sys
import json
import zipfile

import pytest
import torch

from cli_helpers import assert_one_line_error, in_process, save_sharded, training_state
from shardkit.cli.json_out import json_text
from shardkit.errors import ChecksumError
from shardkit.sources import DcpCheckpoint


def _strict_json(text: str):
    """``json.loads`` refusing the bare words ``NaN`` / ``Infinity`` that are not JSON (as ``jq`` does)."""
    def refuse(word):
        raise AssertionError(f"not JSON: {word}")
    return json.loads(text, parse_constant=refuse)


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_damaged_source_is_exit_1_for_every_tool_but_diff_and_a_taken_destination_is_2(tmp_path):
    ckpt = save_sharded(training_state(), tmp_path / "ck")
    (tmp_path / "taken").mkdir()
    assert "already exists" in assert_one_line_error(
        *in_process("reshard", ckpt, tmp_path / "taken", "--world-size", "3"), expected_code=2)
    assert "already exists" in assert_one_line_error(
        *in_process("convert", ckpt, tmp_path / "taken", "--to", "hf"), expected_code=2)
    _flip(ckpt / "rank_1.safetensors", (ckpt / "rank_1.safetensors").stat().st_size - 5)
    assert in_process("validate", ckpt)[0] == 1
    for argv in (("reshard", ckpt, tmp_path / "o", "--world-size", "3"),
                 ("convert", ckpt, tmp_path / "o", "--to", "hf"),
                 ("convert", ckpt, tmp_path / "o", "--to", "distributed")):
        assert "checksum" in assert_one_line_error(*in_process(*argv), expected_code=1)
    assert not (tmp_path / "o").exists()
    # diff keeps diff(1)'s codes: 1 means "they differ", so a damaged side is trouble, 2
    assert "checksum" in assert_one_line_error(*in_process("diff", ckpt, ckpt, "--verify"), expected_code=2)


def test_the_top_level_help_states_the_codes_the_subcommands_use():
    code, out, _ = in_process("--help")
    assert code == 0
    assert "1  the checkpoint is bad" in out and "diff: they differ" in out and "a destination that exists" in out
    for command, phrase in (("reshard", "1 SRC is incomplete or corrupt"), ("convert", "1 SRC is incomplete or corrupt"),
                            ("diff", "1 they differ, 2 bad input or a damaged checkpoint")):
        assert phrase in in_process(command, "--help")[1], command


def test_json_text_writes_non_finite_floats_as_strings():
    text = json_text({"a": [float("inf"), -float("inf"), float("nan"), 1.5], "b": (2, "é")}, indent=None)
    assert text == '{"a": ["Infinity", "-Infinity", "NaN", 1.5], "b": [2, "é"]}'
    assert json_text(object(), default=lambda o: float("nan")) == '"NaN"'


def test_json_output_stays_json_with_nan_values_and_an_infinite_relative_difference(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(3), "loss": float("nan")}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    dcp.save({"w": torch.ones(3), "loss": 1.0}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    code, out, err = in_process("inspect", tmp_path / "a", "--json")
    assert code == 0, err
    assert _strict_json(out)["objects"]["loss"] == "NaN"
    code, out, err = in_process("diff", tmp_path / "a", tmp_path / "b", "--json")
    assert code == 1, err
    report = _strict_json(out)
    (w,) = [t for t in report["tensors"] if t["name"] == "w"]
    assert w["max_rel"] == "Infinity" and w["max_abs"] == 1.0  # all zero in A: no finite relative difference
    assert report["values"]["loss"] == ["NaN", 1.0]


def test_validate_reads_the_record_of_a_tensor_with_no_elements(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(4.0), "empty": torch.zeros(0, 3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert in_process("validate", tmp_path / "dcp")[0] == 0
    with DcpCheckpoint(str(tmp_path / "dcp")) as ck:
        (chunk,) = ck.tensors["empty"].chunks
        assert ck.read("empty").shape == (0, 3)
    _flip(tmp_path / "dcp" / chunk.file_name, chunk.offset + _pickle_start(tmp_path / "dcp" / chunk.file_name, chunk) + 2)
    code, out, err = in_process("validate", tmp_path / "dcp")
    assert code == 1 and "empty" in out and "CRC-32" in out, (out, err)
    with DcpCheckpoint(str(tmp_path / "dcp")) as ck, pytest.raises(ChecksumError, match="empty"):
        ck.read("empty")


def _pickle_start(path, chunk) -> int:
    """Where the record's ``data.pkl`` bytes begin, relative to the record (past the zip local header)."""
    with open(path, "rb") as f:
        f.seek(chunk.offset)
        record = f.read(chunk.length)
    with zipfile.ZipFile(io.BytesIO(record)) as z:
        at = next(i for i in z.infolist() if i.filename.endswith("data.pkl")).header_offset
    name_len, extra_len = (int.from_bytes(record[at + k:at + k + 2], "little") for k in (26, 28))
    return at + 30 + name_len + extra_len


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["convert", "--help"]])
def test_help_answers_without_importing_torch(argv):
    # `shardkit.storage.json_io` (for --json) pulled in the whole storage package, and torch with
    # it: `shardkit --help` took 2.2 s instead of 0.16 s. The package now loads its names on use.
    code = ("import sys\nfrom shardkit.cli import main\nsys.argv = ['shardkit', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"

"""diff's inf and non-plain DCP values, validate's DCP value records, a DCP checkpoint on a remote store.

All in this process (``in_process`` / the library): each case saves a tiny DCP checkpoint with
``dcp.save(no_dist=True)``.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from cli_helpers import in_process
from shardkit.offline import diff_checkpoints
from shardkit.offline.diff import _same_values
from shardkit.sources import DcpCheckpoint

BIG = torch.finfo(torch.float64).max
MAX = "max"  # the largest finite value of the dtype under test


def _dcp(path, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize("a, b", [
    ([1.0, float("inf")], [1.0, MAX]),
    ([-float("inf")], [f"-{MAX}"]),
    ([float("inf")], [-float("inf")]),
    ([float("nan")], [float("inf")]),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
def test_inf_equals_only_inf_of_the_same_sign(a, b, dtype):
    top = torch.finfo(torch.float64 if dtype == torch.complex128 else dtype).max
    x, y = (torch.tensor([{MAX: top, f"-{MAX}": -top}.get(v, v) for v in vs], dtype=torch.float64).to(dtype)
            for vs in (a, b))
    assert not _same_values(x, y) and not _same_values(y, x), (x, y)


def test_nan_equals_nan_and_signed_zeros_and_infs_are_equal():
    nan2 = torch.tensor([0x7FF8000000000001], dtype=torch.int64).view(torch.float64)  # another NaN payload
    assert _same_values(torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
                        torch.cat([nan2, torch.tensor([0.0, float("inf")], dtype=torch.float64)]))
    assert _same_values(torch.tensor([complex(float("nan"), 1.0)]), torch.tensor([complex(float("nan"), 1.0)]))
    assert not _same_values(torch.tensor([complex(float("nan"), 1.0)]), torch.tensor([complex(float("nan"), 2.0)]))


def test_diff_of_inf_against_the_largest_float_differs(tmp_path):
    a = _dcp(tmp_path / "a", {"w": torch.tensor([1.0, float("inf")], dtype=torch.float64)})
    b = _dcp(tmp_path / "b", {"w": torch.tensor([1.0, BIG], dtype=torch.float64)})
    code, out, err = in_process("diff", a, b)
    assert code == 1 and "w  values differ" in out, (out, err)


NOT_PLAIN = {
    "bytes": (b"state-A", b"state-B"),
    "complex": (1 + 2j, 1 + 3j),
    "set": ({1, 2}, {1, 3}),
    "dtype": (torch.float32, torch.bfloat16),
    "tuple with a tensor": ((torch.arange(3), 1), (torch.arange(3) + 1, 1)),
    "tuple with a tensor of another dtype": ((torch.arange(3), 1), (torch.arange(3).int(), 1)),
}


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_diff_compares_dcp_values_that_are_not_plain(tmp_path, case):
    va, vb = NOT_PLAIN[case]
    w = torch.ones(3)
    a = _dcp(tmp_path / "a", {"w": w, "extra": va})
    b = _dcp(tmp_path / "b", {"w": w, "extra": vb})
    same = _dcp(tmp_path / "same", {"w": w, "extra": va})
    report = diff_checkpoints(str(a), str(b))
    assert not report.identical and report.values  # named by leaf where a container holds it: extra.0
    assert all(n == "extra" or n.startswith("extra.") for n in report.values), report.values
    assert diff_checkpoints(str(a), str(same)).identical


def test_diff_prints_a_differing_bytes_value_and_exits_1(tmp_path):
    a = _dcp(tmp_path / "a", {"w": torch.ones(3), "extra": b"state-A"})
    b = _dcp(tmp_path / "b", {"w": torch.ones(3), "extra": b"state-B"})
    code, out, err = in_process("diff", a, b)
    assert code == 1 and "extra  value b'state-A' -> b'state-B'" in out, (out, err)


def test_validate_reports_a_corrupt_dcp_value_record(tmp_path):
    path = _dcp(tmp_path / "dcp", {"w": torch.ones(3), "step": 1234567})
    with DcpCheckpoint(str(path)) as ck:
        chunk = ck.values["step"]
    data = bytearray((path / chunk.file_name).read_bytes())
    record = bytes(data[chunk.offset:chunk.offset + chunk.length])
    data[chunk.offset + record.index((1234567).to_bytes(4, "little"))] ^= 0x01  # the int inside data.pkl
    (path / chunk.file_name).write_bytes(bytes(data))
    code, out, err = in_process("validate", path)
    assert code == 1 and "step:" in out and "CRC-32" in out, (out, err)


@pytest.fixture
def memory_dcp(tmp_path):
    """A complete DCP checkpoint copied onto fsspec's memory store: its ``memory://`` URL."""
    import fsspec

    local = _dcp(tmp_path / "dcp", {"w": torch.ones(3), "step": 1})
    fs, root = fsspec.filesystem("memory"), f"/dcp-{uuid.uuid4().hex[:8]}"
    for name in os.listdir(local):
        fs.pipe(f"{root}/{name}", (local / name).read_bytes())
    yield f"memory://{root.lstrip('/')}"
    fs.rm(root, recursive=True)


def test_inspect_and_validate_recognise_a_dcp_checkpoint_on_a_remote_store(memory_dcp):
    from shardkit.cli.target import DCP, checkpoint_kind

    assert checkpoint_kind(memory_dcp) == DCP
    code, out, err = in_process("inspect", memory_dcp)
    assert code == 0 and "PyTorch DCP checkpoint" in out and "step = 1" in out, (out, err)
    code, out, err = in_process("validate", memory_dcp)
    assert code == 0 and out.strip() == f"{memory_dcp}: ok", (out, err)


def test_an_empty_remote_location_is_still_reported_as_missing():
    code, out, err = in_process("validate", f"memory://nothing-{uuid.uuid4().hex[:8]}")
    assert code == 1 and "does not exist" in out, (out, err)

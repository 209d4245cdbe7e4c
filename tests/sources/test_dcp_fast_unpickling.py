"""The C unpicklers that read DCP's ``.metadata`` and its records' ``data.pkl`` hand out only the globals
they allow: a real checkpoint reads as ``pickle`` reads it, anything else is left to the restricted
unpickler (which refuses code without calling it)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardkit.errors import MetadataError
from shardkit.sources import DcpCheckpoint, read_dcp_metadata

CALLED = []


def boom(*args):
    CALLED.append(args)
    return None


class _Hostile:
    def __reduce__(self):
        return (boom, ("ran",))


def test_a_real_metadata_reads_as_pickle_reads_it(tmp_path):
    dcp.save({"w": torch.ones(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 3},
             checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        trusted = pickle.load(f)  # the test's own file
    meta = read_dcp_metadata(str(tmp_path))
    assert meta.state_dict_metadata == trusted.state_dict_metadata
    assert meta.storage_data == trusted.storage_data
    with DcpCheckpoint(str(tmp_path)) as ck:
        assert torch.equal(ck.read("w"), torch.ones(4, 3)) and ck.read("b").dtype == torch.bfloat16


def test_a_metadata_holding_a_foreign_callable_is_refused_and_nothing_is_called(tmp_path):
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    meta.planner_data = _Hostile()
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(meta, f, protocol=4)
    CALLED.clear()
    with pytest.raises(MetadataError, match="restricted unpickler"):
        read_dcp_metadata(str(tmp_path))
    assert CALLED == []

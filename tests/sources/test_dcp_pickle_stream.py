"""pickle_downgrade streams: memory stays near the output's size, and an opcode flood is refused by count.

Keeping every opcode (a list of genops' tuples plus one object each) cost 160-315x the file's size.
"""

from __future__ import annotations

import io
import pickle
import tracemalloc

import pytest
import torch

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.sources import read_dcp_metadata
from shardkit.sources.pickle_downgrade import downgrade_pickle


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_downgrading_a_flood_of_one_byte_opcodes_holds_about_the_output():
    data = b"\x80\x04" + b"N" * 200_000 + b"."  # 200k NONE opcodes
    out = []
    peak = _peak_bytes(lambda: out.append(downgrade_pickle(data, source="flood")))
    assert out[0] == b"\x80\x02" + data[2:]
    assert peak < 8 * len(data), peak  # was ~100x: a tuple and an object per opcode


def test_an_opcode_flood_past_the_knob_is_a_metadata_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "DCP_MAX_METADATA_OPS", 1000, raising=False)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"N" * 2000 + b".")
    with pytest.raises(MetadataError, match="DCP_MAX_METADATA_OPS"):
        read_dcp_metadata(str(tmp_path))


def test_a_real_metadata_under_the_knob_still_reads(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({f"t{i}": torch.arange(4.0) for i in range(50)}, checkpoint_id=str(tmp_path), no_dist=True)
    meta = read_dcp_metadata(str(tmp_path))
    assert sorted(meta.state_dict_metadata) == sorted(f"t{i}" for i in range(50))


class _Named:
    pass


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_rewrite_keeps_globals_memo_and_strings(protocol):
    value = {"a": ["x" * 300, "x" * 300, ("y", 1.5, None, True)], "b": io.BytesIO, "c": io.BytesIO,
             **{f"k{i}": f"v{i % 7}" for i in range(400)}}  # memo indices past 255 (LONG_BINPUT)
    out = downgrade_pickle(pickle.dumps(value, protocol=protocol), source="t")
    assert pickle.loads(out) == value  # the test's own data: trusted
    assert max(op.proto for op, _, _ in __import__("pickletools").genops(out)) <= 2

"""The offline engine under the CLI: read-ahead buffers, DCP chunks read in place, the check before publishing."""

from __future__ import annotations

import threading

import pytest
import torch

from cli_helpers import save_sharded, training_state
from shardkit import knobs
from shardkit.checkpoint import load_consolidated, validate_distributed
from shardkit.offline import reshard_checkpoint
from shardkit.offline.write_overlap import ReadAhead
from shardkit.sources import DcpCheckpoint, open_source


def _items(sizes, log):
    def fill_for(i):
        def fill(out):
            log.append((i, threading.current_thread().name))
            out.fill_(i)
        return fill
    return [(i, torch.float32, (n,), fill_for(i)) for i, n in enumerate(sizes)]


def test_read_ahead_gives_each_item_filled_and_reads_the_next_in_the_background():
    log = []
    with ReadAhead(_items([4, 3, 5, 0, 2], log)) as ahead:
        for i, n in enumerate([4, 3, 5, 0, 2]):
            t = ahead.lazy(i).load()
            assert t.shape == (n,) and bool((t == i).all())
    assert [i for i, _ in log] == [0, 1, 2, 3, 4]
    assert all(name.startswith("shardkit-readahead") for i, name in log if i > 0)


def test_read_ahead_out_of_order_and_too_large_items_are_read_when_asked(monkeypatch):
    monkeypatch.setattr(knobs, "OFFLINE_READ_AHEAD_MAX_BYTES", 16)
    log = []
    with ReadAhead(_items([2, 8, 3, 1], log)) as ahead:   # item 1 is 32 bytes: never read ahead
        assert bool((ahead.take(0) == 0).all())
        assert bool((ahead.take(2) == 2).all())           # not the next one: waited for, then read now
        assert bool((ahead.take(1) == 1).all())
        assert bool((ahead.take(3) == 3).all())
    assert sorted({i for i, _ in log}) == [0, 1, 2, 3]
    assert all(name == threading.current_thread().name for i, name in log if i == 1)


def test_read_ahead_out_of_host_memory_is_a_typed_error_naming_the_tensor():
    from shardkit.errors import CheckpointIOError

    with ReadAhead([("huge", torch.float32, (10**12,), lambda out: None)]) as ahead:
        with pytest.raises(CheckpointIOError, match=r"out of host memory: a tensor of shape \[1000000000000\]") as e:
            ahead.take("huge")
    assert e.value.errno == 12


@pytest.mark.parametrize("ahead_bytes", [0, 1 << 30])
def test_reshard_equals_the_source_with_and_without_read_ahead(tmp_path, monkeypatch, ahead_bytes):
    monkeypatch.setattr(knobs, "OFFLINE_READ_AHEAD_MAX_BYTES", ahead_bytes)
    src = save_sharded(training_state(rows=11), tmp_path / "src", world_size=2)
    for ws in (1, 3, 4):
        reshard_checkpoint(str(src), str(tmp_path / f"ws{ws}"), ws)
        assert validate_distributed(str(tmp_path / f"ws{ws}")).ok
        a, b = load_consolidated(str(src)), load_consolidated(str(tmp_path / f"ws{ws}"))
        assert a["step"] == b["step"]
        for part in ("model", "optim"):
            for name, t in a[part].items():
                assert b[part][name].equal(t), (ws, part, name)


def test_check_before_publish_without_hashing_still_sees_a_wrong_size(tmp_path):
    src = save_sharded(training_state(), tmp_path / "src")
    with open(src / "rank_0.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    report = validate_distributed(str(src), hash_bytes=False)
    assert not report.ok and "rank_0.safetensors" in report.problems[0]


def test_distributed_source_reads_boxes_into_a_given_tensor(tmp_path):
    src = save_sharded(training_state(rows=9), tmp_path / "src", world_size=2)
    w = training_state(rows=9)["model"]["w"]
    with open_source(str(src)) as source:
        out = torch.empty(4, 4)
        source.read_into("model.w", out, (3, 0))
        assert out.equal(w[3:7])
        assert source.read("model.w").equal(w)


def test_dcp_chunks_are_read_in_place_and_other_layouts_through_torch_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(12, 5, generator=g), "ids": torch.arange(7), "h": torch.randn(6, generator=g).half(),
             "t": torch.randn(4, 3, generator=g).t(), "s": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with DcpCheckpoint(str(tmp_path / "dcp")) as ck:
        for name, t in state.items():
            out = torch.empty(t.shape, dtype=t.dtype)
            ck.read_into(name, out)
            assert out.equal(t), name
            assert ck.read(name).equal(t)
        part = torch.empty(5, 5)
        ck.read_into("a", part, (4, 0))
        assert part.equal(state["a"][4:9])
        in_place = {c.box.sizes: span for c, span in ck._spans.items()}
    assert in_place[(12, 5)] is not None      # a plain contiguous chunk: copied straight from the file
    assert in_place[(3, 4)] is None           # a transposed one: torch.load decides

"""The first-call async benchmark's children run each implementation for real in a new process."""

from __future__ import annotations

import pytest

from shardkit.bench.checkpoint_suites.async_first import IMPLS, PREPARED, first_call_blocked
from shardkit.checkpoint import load_distributed, validate_distributed
from shardkit.bench.workload import make_state


@pytest.mark.parametrize("impl", ["shardkit", PREPARED])
def test_the_shardkit_child_times_its_first_call_and_its_save_completes(tmp_path, impl):
    # (the dcp child runs in the benchmark itself; shardkit's children here keep the suite fast)
    assert "torch.distributed.checkpoint.async_save" in IMPLS
    assert first_call_blocked(impl, 1 << 20, str(tmp_path / "out"), settle_s=0, ballast_bytes=1 << 20,
                              timeout_s=300) > 0
    assert validate_distributed(tmp_path / "out").ok
    expect = make_state(1 << 20)
    loaded = load_distributed(tmp_path / "out", 0, 1)
    assert loaded.keys() == expect.keys()
    assert all(loaded[k].equal(v) for k, v in expect.items())


def test_an_unknown_impl_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known:.*shardkit"):
        first_call_blocked("nope", 1 << 20, str(tmp_path))

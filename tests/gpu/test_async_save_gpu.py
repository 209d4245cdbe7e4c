"""AsyncCheckpointer with CUDA tensors: pinned staging buffers, one synchronize, snapshot semantics.

Skipped without CUDA (see tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from shardkit.checkpoint import load_distributed
from shardkit.checkpoint.background.checkpointer import AsyncCheckpointer

pytestmark = pytest.mark.gpu


def test_cuda_state_is_staged_to_reused_pinned_buffers_and_snapshotted(tmp_path):
    w = torch.randn(1024, 512, device="cuda")
    b = torch.randn(7, device="cuda").to(torch.bfloat16)
    expect = {"w": w.cpu(), "b": b.cpu()}
    state = {"model": {"w": w, "b": b}, "cpu": torch.arange(5), "step": 1}
    with AsyncCheckpointer(tmp_path / "unused", 0, 1, None) as ckpt:
        future = ckpt.save_async(state, dir=tmp_path / "s1")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # another stream: only the synchronize in save_async orders it
            w.add_(1)
        b.add_(1)
        future.wait()
        bufs = dict(ckpt._buffers)
        assert bufs[("model", "w")].is_pinned() and bufs[("model", "w")].device.type == "cpu"
        assert not bufs[("cpu",)].is_pinned()
        torch.cuda.synchronize()
        ckpt.save_async(state, dir=tmp_path / "s2").wait()
        assert ckpt._buffers[("model", "w")].data_ptr() == bufs[("model", "w")].data_ptr()
    out = load_distributed(tmp_path / "s1", 0, 1)
    assert torch.equal(out["model"]["w"], expect["w"]) and torch.equal(out["model"]["b"], expect["b"])
    out2 = load_distributed(tmp_path / "s2", 0, 1)
    assert torch.equal(out2["model"]["w"], expect["w"] + 1)

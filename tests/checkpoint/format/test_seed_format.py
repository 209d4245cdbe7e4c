"""A directory in ferrotorch-distributed 0.4's own format loads, reshards and validates unchanged."""

import json

import pytest
import torch
from safetensors.torch import save_file

from shardkit.checkpoint import load_consolidated, load_distributed, load_region, reshard, validate_distributed
from shardkit.errors import MetadataError

W = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
V = torch.arange(4 * 5, dtype=torch.float64).reshape(4, 5)
W_SIZES, V_SIZES = [3, 2, 2], [2, 2, 1]


@pytest.fixture()
def seed_dir(tmp_path):
    """What the seed writes: metadata.json with num_ranks + tensor_specs only, rank_<r>.safetensors."""
    meta = {"num_ranks": 3, "tensor_specs": {
        "w": {"full_shape": [7, 3], "shard_dim": 0, "shard_sizes": W_SIZES},
        "v": {"full_shape": [4, 5], "shard_dim": 1, "shard_sizes": V_SIZES},
    }}
    (tmp_path / "metadata.json").write_text(json.dumps(meta, indent=2))
    for rank in range(3):
        save_file({"w": W.narrow(0, sum(W_SIZES[:rank]), W_SIZES[rank]).contiguous(),
                   "v": V.narrow(1, sum(V_SIZES[:rank]), V_SIZES[rank]).contiguous()},
                  str(tmp_path / f"rank_{rank}.safetensors"))
    return tmp_path


def test_seed_dir_loads_on_same_world(seed_dir):
    for rank in range(3):
        out = load_distributed(seed_dir, rank, 3)
        assert torch.equal(out["w"], W.narrow(0, sum(W_SIZES[:rank]), W_SIZES[rank]))
        assert out["v"].dtype == torch.float64


@pytest.mark.parametrize("m", [1, 2, 4])
def test_seed_dir_reshards(seed_dir, m):
    outs = [reshard(seed_dir, 3, m, r) for r in range(m)]
    assert torch.equal(torch.cat([o["w"] for o in outs], 0), W)
    assert torch.equal(torch.cat([o["v"] for o in outs], 1), V)


def test_seed_dir_region_consolidate_validate(seed_dir):
    assert torch.equal(load_region(seed_dir, "v", (1, 1), (3, 3)), V[1:4, 1:4])
    full = load_consolidated(seed_dir)
    assert torch.equal(full["w"], W) and torch.equal(full["v"], V)
    assert validate_distributed(seed_dir).ok


def test_seed_dir_truncated_file_is_caught_without_checksums(seed_dir):
    path = seed_dir / "rank_2.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(MetadataError, match="the file is truncated"):
        load_distributed(seed_dir, 2, 3)
    assert "truncated" in "\n".join(validate_distributed(seed_dir).problems)

"""save_distributed / load_distributed / reshard / load_region / load_consolidated, single process."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from ckpt_helpers import bits_equal, join_ranks, rank_slice, save_full
from shardkit import knobs
from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    flat_shard_metadata,
    load_consolidated,
    load_distributed,
    load_region,
    read_metadata,
    reshard,
    save_distributed,
    validate_distributed,
)
from shardkit.errors import MetadataError, TensorMismatchError

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod().item()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def test_seed_semantics_single_rank(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.0, 2.0])}
    save_distributed(state, tmp_path, 0, 1, ShardMetadata(1, {}))
    out = load_distributed(tmp_path, 0, 1)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


@pytest.mark.parametrize("n,m", [(2, 4), (4, 2), (3, 2), (4, 3), (1, 5), (3, 3)])
@pytest.mark.parametrize("dim", [0, 1])
def test_reshard_n_to_m(tmp_path, n, m, dim):
    full = torch.randn(7, 5, dtype=torch.float64)
    save_full({"w": full, "r": torch.arange(4)}, tmp_path, n, {"w": dim})
    outs = [load_distributed(tmp_path, r, m) for r in range(m)]
    for r, out in enumerate(outs):
        assert torch.equal(out["w"], rank_slice(full, dim, compute_shard_sizes(full.shape[dim], m), r))
        assert torch.equal(out["r"], torch.arange(4))
    assert torch.equal(join_ranks([o["w"] for o in outs], dim), full)
    per_rank = [reshard(tmp_path, n, m, r)["w"] for r in range(m)]
    assert torch.equal(join_ranks(per_rank, dim), full)


def test_same_world_keeps_uneven_custom_sizes(tmp_path):
    full = torch.arange(20).reshape(10, 2)
    save_full({"w": full}, tmp_path, 3, {"w": 0}, sizes={"w": [1, 7, 2]})
    assert [load_distributed(tmp_path, r, 3)["w"].shape[0] for r in range(3)] == [1, 7, 2]
    assert [load_distributed(tmp_path, r, 2)["w"].shape[0] for r in range(2)] == [5, 5]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(tmp_path, dtype):
    full = random_tensor((6, 4), dtype)
    save_full({"w": full, "s": random_tensor((), dtype, 1)}, tmp_path, 2, {"w": 1})
    outs = [load_distributed(tmp_path, r, 3) for r in range(3)]
    assert bits_equal(join_ranks([o["w"] for o in outs], 1), full)
    assert bits_equal(outs[2]["s"], random_tensor((), dtype, 1))
    with safe_open(os.path.join(tmp_path, "rank_0.safetensors"), "pt") as f:  # a plain safetensors file
        assert bits_equal(f.get_tensor("w"), full[:, :2])


def test_zero_size_dims_scalars_and_empty_state(tmp_path):
    state = {"e": torch.empty(0, 3), "z": torch.empty(4, 0), "s": torch.tensor(3.5)}
    save_full(state, tmp_path / "a", 2, {"e": 0, "z": 0})
    out = load_consolidated(tmp_path / "a")
    assert out["e"].shape == (0, 3) and out["z"].shape == (4, 0) and out["s"].item() == 3.5
    assert load_distributed(tmp_path / "a", 2, 3)["z"].shape == (1, 0)
    save_distributed({}, tmp_path / "b", 0, 1, None)
    assert load_distributed(tmp_path / "b", 0, 1) == {} and validate_distributed(tmp_path / "b").ok


def test_non_contiguous_inputs_and_unicode_names(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    save_distributed({"wéights ✓": base.t(), "every_other": base[:, ::2]}, tmp_path, 0, 1, None)
    out = load_distributed(tmp_path, 0, 1)
    assert torch.equal(out["wéights ✓"], base.t()) and torch.equal(out["every_other"], base[:, ::2])


def test_nested_state_and_plain_leaves(tmp_path):
    w = torch.arange(8.0).reshape(4, 2)
    spec = ShardMetadata(2, {"model.w": TensorShardSpec((4, 2), 0, (2, 2))})
    for rank in range(2):
        state = {"model": {"w": w[2 * rank:2 * rank + 2]},
                 "optim": {"state": {0: {"exp_avg": torch.ones(3), "step": 7}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
                 "epoch": 3, "name": "run", "flag": True, "none": None}
        save_distributed(state, tmp_path, rank, 2, spec, metadata={"note": "hi"})
    out = load_consolidated(tmp_path)
    assert torch.equal(out["model"]["w"], w)
    assert out["optim"]["state"][0]["step"] == 7 and list(out["optim"]["state"]) == [0]
    assert out["optim"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.99)}]
    assert (out["epoch"], out["name"], out["flag"], out["none"]) == (3, "run", True, None)
    assert read_metadata(tmp_path).user_metadata == {"note": "hi"}
    part = load_distributed(tmp_path, 1, 2, keys=["model", "epoch"])
    assert set(part) == {"model", "epoch"} and torch.equal(part["model"]["w"], w[2:])


def test_unsavable_leaf_is_refused_without_pickle(tmp_path):
    with pytest.raises(TypeError, match=r"'cfg.obj' is a object.*never pickles"):
        save_distributed({"cfg": {"obj": object()}}, tmp_path, 0, 1, None)
    with pytest.raises(TensorMismatchError, match="same name 'a.b'"):
        save_distributed({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path, 0, 1, None)


def test_replicated_written_once_with_spread_owners(tmp_path):
    state = {f"r{i}": torch.ones(100 * (i + 1)) for i in range(4)}
    save_full(state, tmp_path, 4, {})
    meta = json.loads((tmp_path / "metadata.json").read_text())
    chunks = [meta["tensor_specs"][n]["chunks"] for n in state]
    assert all(len(c) == 1 for c in chunks)          # written once, whole
    assert sorted(c[0]["file"] for c in chunks) == [f"rank_{r}.safetensors" for r in range(4)]
    for rank in range(4):
        with safe_open(os.path.join(tmp_path, f"rank_{rank}.safetensors"), "pt") as f:
            assert len(list(f.keys())) == 1
    for rank in range(3):
        assert all(torch.equal(load_distributed(tmp_path, rank, 3)[n], t) for n, t in state.items())


def test_load_region_matches_slicing(tmp_path):
    full = torch.randn(9, 7, 3)
    save_full({"w": full}, tmp_path, 4, {"w": 1})
    assert torch.equal(load_region(tmp_path, "w", (2, 1, 0), (5, 5, 2)), full[2:7, 1:6, 0:2])
    assert load_region(tmp_path, "w", (0, 0, 0), (0, 7, 3)).shape == (0, 7, 3)
    with pytest.raises(TensorMismatchError, match="dimension 1"):
        load_region(tmp_path, "w", (0, 5, 0), (1, 3, 1))


def test_small_scratch_buffer_still_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 40)
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 64)
    full = torch.randn(11, 13, 5)
    save_full({"w": full}, tmp_path, 3, {"w": 2})
    outs = [load_distributed(tmp_path, r, 2)["w"] for r in range(2)]
    assert torch.equal(torch.cat(outs, 2), full)


def test_flat_shard_metadata_seed_semantics(tmp_path):
    meta = flat_shard_metadata({"w": torch.zeros(3), "n": {"b": torch.zeros(2)}, "step": 1}, 4)
    assert meta.num_ranks == 4
    assert meta.tensor_specs["w"] == TensorShardSpec((12,), 0, (3, 3, 3, 3))
    assert set(meta.tensor_specs) == {"w", "n.b"}
    for rank in range(4):
        save_distributed({"w": torch.full((3,), float(rank))}, tmp_path, rank, 4,
                         flat_shard_metadata({"w": torch.zeros(3)}, 4))
    assert load_distributed(tmp_path, 1, 2)["w"].tolist() == [2, 2, 2, 3, 3, 3]


def test_overwrite_same_directory(tmp_path):
    save_full({"w": torch.zeros(4)}, tmp_path, 2, {"w": 0})
    save_full({"w": torch.ones(6)}, tmp_path, 2, {"w": 0}, overwrite=True)  # no group: must be asked for
    assert torch.equal(load_consolidated(tmp_path)["w"], torch.ones(6))
    assert validate_distributed(tmp_path).ok


def test_shape_and_rank_errors_are_helpful(tmp_path):
    spec = ShardMetadata(2, {"w": TensorShardSpec((4, 3), 0, (2, 2))})
    with pytest.raises(TensorMismatchError, match=r"'w' on rank 1 of 2 has shape \[3, 3\].*gives this rank \[2, 3\]"):
        save_distributed({"w": torch.zeros(3, 3)}, tmp_path, 1, 2, spec)
    with pytest.raises(MetadataError, match=r"rank 2 is out of range for world_size 2; valid ranks are 0..1"):
        save_distributed({"w": torch.zeros(2, 3)}, tmp_path, 2, 2, spec)
    with pytest.raises(MetadataError, match=r"sum to 5, but dimension 0 .* is 4"):
        save_distributed({}, tmp_path, 0, 2, ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 3))}))
    with pytest.raises(TensorMismatchError, match="names 'x', which is not in the state"):
        save_distributed({}, tmp_path, 0, 1, ShardMetadata(1, {"x": TensorShardSpec((1,), 0, (1,))}))
    save_full({"w": torch.zeros(4)}, tmp_path / "ok", 2, {"w": 0})
    with pytest.raises(MetadataError, match="rank 3 is out of range for world_size 3"):
        load_distributed(tmp_path / "ok", 3, 3)
    with pytest.raises(MetadataError, match="saved by 2 ranks"):
        reshard(tmp_path / "ok", 4, 2, 0)


def test_no_group_ranks_with_different_plain_values_are_reported(tmp_path):
    """Without a group, plain values are stored once: ranks that disagree make an incomplete checkpoint."""
    from shardkit.checkpoint import ShardMetadata, TensorShardSpec, load_distributed, save_distributed, validate_distributed
    from shardkit.errors import IncompleteCheckpointError

    spec = ShardMetadata(2, {"w": TensorShardSpec((4,), 0, (2, 2))})
    for rank in range(2):
        save_distributed({"w": torch.zeros(2), "rank": rank}, str(tmp_path), rank, 2, spec)
    # Format 2: the last rank commits only when every rank's record carries its save_id; none does here.
    report = validate_distributed(str(tmp_path))
    assert not report.ok and any("never finished" in p for p in report.problems)
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        load_distributed(str(tmp_path), 0, 2)

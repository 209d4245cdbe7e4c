"""Distributed checkpoints on real Gloo ranks: save on 4, load on 3, 4 and 5, async saves.

Each spawn costs seconds, so one spawn does many checks: the 4-rank spawn
saves the same state three ways (with the group, without it, and with an
AsyncCheckpointer on a dedicated group), the 5-rank spawn loads every one of
them as world sizes 3, 4 and 5 (loading needs no collective), and the parent
compares each rank's output with slices of the original full tensors, bit
for bit.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from ranks import run_ranks
from state_leaves import leaves
from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    load_distributed,
    save_distributed,
    validate_distributed,
)
from shardkit.checkpoint.background.checkpointer import AsyncCheckpointer
from shardkit.errors import AsyncCheckpointError

pytestmark = pytest.mark.multiproc

SAVE_WORLD = 4
INCOMPLETE_WORDS = re.compile(r"incomplete|missing|never finished|no metadata|does not exist", re.I)

#: name -> (shape, dtype, shard_dim, shard sizes when saved on 4 ranks, or None for replicated)
TENSORS = {
    "model.layers.0.w": ((10, 6), torch.bfloat16, 0, (3, 3, 2, 2)),
    "model.layers.0.b": ((7,), torch.float32, 0, (2, 2, 2, 1)),
    "model.layers.1.w": ((5, 9), torch.float16, 1, (1, 4, 2, 2)),   # uneven, not the default split
    "model.emb": ((3, 4, 5), torch.int64, 2, (2, 1, 1, 1)),
    "model.tiny": ((2,), torch.float64, 0, (1, 1, 0, 0)),           # empty shards on ranks 2, 3
    "model.scale": ((), torch.float32, None, None),                 # 0-d, replicated
    "model.rep.a": ((3,), torch.float64, None, None),
    "model.rep.b": ((2, 2), torch.int32, None, None),
    "model.rep.mask": ((4,), torch.bool, None, None),
    "model.rep.u8": ((5,), torch.uint8, None, None),
    "optim.state.0.exp_avg": ((10, 6), torch.float32, 0, (3, 3, 2, 2)),
    "optim.state.1.exp_avg": ((7,), torch.float32, 0, (2, 2, 2, 1)),
}
#: replicated tensors left out of the shard spec on purpose: "not named = replicated"
UNNAMED = {"model.rep.u8"}
PLAIN = {
    "optim.state.0.step": 1200,
    "optim.state.1.step": 1200,
    "optim.param_groups.0.lr": 0.001,
    "optim.param_groups.0.name": "decay",
    "optim.param_groups.0.nesterov": False,
    "optim.param_groups.0.clip": None,
    "epoch": 3,
}


def full_tensor(name: str, seed: int = 0) -> torch.Tensor:
    shape, dtype, _, _ = TENSORS[name]
    g = torch.Generator().manual_seed(_stable_seed(name, seed))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)


def _stable_seed(name: str, seed: int) -> int:
    return (sum(ord(c) * 131**i for i, c in enumerate(name)) + seed * 7919) % (2**31)


def saved_shard(name: str, rank: int, seed: int = 0) -> torch.Tensor:
    _, _, dim, sizes = TENSORS[name]
    full = full_tensor(name, seed)
    if dim is None:
        return full
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank])


def spec() -> ShardMetadata:
    specs = {}
    for name, (shape, _, dim, sizes) in TENSORS.items():
        if name in UNNAMED:
            continue
        specs[name] = TensorShardSpec(full_shape=shape, shard_dim=dim, shard_sizes=tuple(sizes) if sizes else ())
    return ShardMetadata(num_ranks=SAVE_WORLD, tensor_specs=specs)


def nested_state(rank: int, seed: int = 0) -> dict:
    """This rank's nested state: model dict, optimizer lists, plain leaves."""
    t = {name: saved_shard(name, rank, seed) for name in TENSORS}
    return {
        "model": {
            "layers": {"0": {"w": t["model.layers.0.w"], "b": t["model.layers.0.b"]},
                       "1": {"w": t["model.layers.1.w"]}},
            "emb": t["model.emb"],
            "tiny": t["model.tiny"],
            "scale": t["model.scale"],
            "rep": {"a": t["model.rep.a"], "b": t["model.rep.b"], "mask": t["model.rep.mask"],
                    "u8": t["model.rep.u8"]},
        },
        "optim": {
            "state": [{"exp_avg": t["optim.state.0.exp_avg"], "step": 1200},
                      {"exp_avg": t["optim.state.1.exp_avg"], "step": 1200}],
            "param_groups": [{"lr": 0.001, "name": "decay", "nesterov": False, "clip": None}],
        },
        "epoch": 3,
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so -0.0 vs 0.0 and NaN payloads count."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def expected_slice(name: str, rank: int, world: int, seed: int = 0) -> torch.Tensor:
    """Rank's slice when loading on ``world`` ranks: the saved split on 4, the default split otherwise."""
    shape, _, dim, saved_sizes = TENSORS[name]
    full = full_tensor(name, seed)
    if dim is None:
        return full
    sizes = saved_sizes if world == SAVE_WORLD else compute_shard_sizes(shape[dim], world)
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


def assert_loaded(out: dict, rank: int, world: int, label: str, seed: int = 0) -> None:
    flat = leaves(out)
    assert set(flat) == set(TENSORS) | set(PLAIN), f"{label}: keys differ: {sorted(set(flat) ^ (set(TENSORS) | set(PLAIN)))}"
    for name in TENSORS:
        got, want = flat[name], expected_slice(name, rank, world, seed)
        assert isinstance(got, torch.Tensor), f"{label} {name}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{label} {name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        assert torch.equal(bits(got), bits(want)), f"{label} {name}: values differ on rank {rank}/{world}"
    for name, value in PLAIN.items():
        assert flat[name] == value and type(flat[name]) is type(value), f"{label} {name}: {flat[name]!r}"


# --- rank functions (module level: spawned ranks import them) -------------------------


def _save_on_four(rank, world_size, root):
    group = dist.group.WORLD
    state = nested_state(rank)
    save_distributed(state, os.path.join(root, "with_group"), rank, world_size, spec(), group=group)
    save_distributed(state, os.path.join(root, "no_group"), rank, world_size, spec())
    dist.barrier()  # every rank's file is written before anyone checks the no-group one

    # Async on a dedicated group; the caller mutates every tensor right after save_async.
    with AsyncCheckpointer(os.path.join(root, "async"), rank, world_size, spec(), group=group) as ckpt:
        future = ckpt.save_async(state)
        for leaf in leaves(state).values():
            if isinstance(leaf, torch.Tensor):
                leaf.logical_not_() if leaf.dtype == torch.bool else leaf.add_(1)
        future.wait()
        # A second save on the same checkpointer, new values, reused staging buffers.
        future = ckpt.save_async(nested_state(rank, seed=1), dir=os.path.join(root, "async_2"))
    assert future.done()

    # A save that fails on rank 2 only fails on every rank; the same checkpointers then save fine.
    with AsyncCheckpointer(os.path.join(root, "async_fail"), rank, world_size, spec(), group=group) as ckpt:
        bad = nested_state(rank)
        if rank == 2:
            bad["model"]["layers"]["0"]["w"] = torch.zeros(1, 6, dtype=torch.bfloat16)
        future = ckpt.save_async(bad)
        try:
            future.wait(timeout=60)
            failure = None
        except AsyncCheckpointError as e:
            failure = str(e)
        ckpt.save_async(nested_state(rank), dir=os.path.join(root, "async_after_fail")).wait()

    # Two 2-rank groups, {0, 1} and {2, 3}, each saving asynchronously while it trains.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    sums = _pair_async_while_training(rank % 2, pair, os.path.join(root, f"pair{rank // 2}"))
    return {"sums": sums, "failure": failure}


def _load_as_3_4_5(rank, world_size, root):
    """Each process loads as rank ``rank`` of worlds 3, 4 and 5 and checks in place.

    Returns {(checkpoint, world): None or the failure}; tensors do not travel
    back (shared-memory handles die with the rank).
    """
    out = {}
    for world in (3, 4, 5):
        if rank >= world:
            continue
        for name in ("with_group", "no_group", "async", "async_2", "async_after_fail"):
            try:
                loaded = load_distributed(os.path.join(root, name), rank, world)
                assert_loaded(loaded, rank, world, f"{name} on {world}", seed=1 if name == "async_2" else 0)
                out[(name, world)] = None
            except Exception as e:  # noqa: BLE001 - reported per case by the parent
                out[(name, world)] = f"{type(e).__name__}: {e}"
    return out


def _pair_async_while_training(rank, pair, root):
    """Async saves on a 2-rank group while the caller keeps issuing collectives on that same group.

    ``rank`` is the rank in the pair; the checkpointer makes its own Gloo
    group, so the training all_reduces and the save's collectives never pair
    up wrongly. Returns the all_reduce sums seen by training.
    """
    sizes = (3, 2)
    full = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    shard = full[sum(sizes[:rank]) : sum(sizes[: rank + 1])].clone()
    meta = ShardMetadata(num_ranks=2, tensor_specs={"w": TensorShardSpec((5, 4), 0, sizes)})
    sums = []
    with AsyncCheckpointer(os.path.join(root, "a"), rank, 2, meta, group=pair) as ckpt:
        for i in range(3):
            future = ckpt.save_async({"w": shard, "step": i}, dir=os.path.join(root, f"a{i}"))
            shard.add_(1000)  # training goes on
            total = torch.zeros(1)
            for _ in range(20):
                t = torch.ones(1)
                dist.all_reduce(t, group=pair)
                total += t
            future.wait()
            sums.append(total.item())
    # The user's own group used as is: nothing else runs on it meanwhile.
    with AsyncCheckpointer(os.path.join(root, "b"), rank, 2, meta, group=pair, dedicated_group=False) as ckpt:
        ckpt.save_async({"w": shard, "step": 99}).wait()
    return sums


# --- tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_rank_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("multirank")
    results = run_ranks(_save_on_four, SAVE_WORLD, root, str(root))
    # 20 all_reduces of 1 over 2 ranks per save, undisturbed by the saves' own collectives
    assert [r["sums"] for r in results] == [[40.0, 40.0, 40.0]] * SAVE_WORLD
    (root / "failures.json").write_text(json.dumps([r["failure"] for r in results]))
    return root


@pytest.fixture(scope="module")
def loads(four_rank_saves):
    per_rank = run_ranks(_load_as_3_4_5, 5, four_rank_saves, str(four_rank_saves))
    return {(name, world, rank): out for rank, d in enumerate(per_rank) for (name, world), out in d.items()}


@pytest.mark.parametrize("name", ["with_group", "no_group", "async", "async_2", "async_after_fail"])
def test_saved_on_4_is_complete(four_rank_saves, name):
    report = validate_distributed(os.path.join(four_rank_saves, name))
    assert report.ok, report.problems


@pytest.mark.parametrize("world", [3, 4, 5])
@pytest.mark.parametrize("name", ["with_group", "no_group", "async", "async_2", "async_after_fail"])
def test_load_on_world_bit_exact(loads, name, world):
    """async: the values at save_async, not the ones mutated right after; async_2: the second save's."""
    failures = {rank: loads[(name, world, rank)] for rank in range(world) if loads[(name, world, rank)]}
    assert not failures, failures


def test_async_failure_on_one_rank_fails_the_save_on_every_rank(four_rank_saves):
    failures = json.loads((four_rank_saves / "failures.json").read_text())
    assert all(failures), f"some ranks' wait() did not raise: {failures}"
    assert "shape" in failures[2], failures[2]
    assert all("rank 2" in f for i, f in enumerate(failures) if i != 2), failures
    report = validate_distributed(os.path.join(four_rank_saves, "async_fail"))
    assert not report.ok and INCOMPLETE_WORDS.search(" ".join(report.problems)), report.problems


def test_replicated_tensors_written_once_by_spread_owners(four_rank_saves):
    root = os.path.join(four_rank_saves, "with_group")
    with open(os.path.join(root, "metadata.json")) as f:
        meta = json.load(f)
    keys_by_rank = {}
    for r in range(SAVE_WORLD):
        with safe_open(os.path.join(root, f"rank_{r}.safetensors"), "pt") as f:
            keys_by_rank[r] = set(f.keys())
    replicated = [n for n, (_, _, dim, _) in TENSORS.items() if dim is None]
    owners = {}
    for name in replicated:
        holders = [r for r, keys in keys_by_rank.items() if name in keys]
        assert len(holders) == 1, f"{name} is in the files of ranks {holders}; a replicated tensor is written once"
        owners[name] = holders[0]
        recorded = [c["file"] for c in meta["tensor_specs"][name]["chunks"]]   # format 2: the chunk's file
        assert recorded == [f"rank_{holders[0]}.safetensors"], f"{name}: metadata says {recorded}, rank {holders[0]} holds it"
    assert len(set(owners.values())) > 1, f"every replicated tensor went to one rank: {owners}"
    for name, (_, _, dim, sizes) in TENSORS.items():
        if dim is not None:
            holders = [r for r, keys in keys_by_rank.items() if name in keys]
            assert set(holders) >= {r for r in range(SAVE_WORLD) if sizes[r] > 0}, (name, holders)


@pytest.mark.parametrize("pair", [0, 1])
def test_async_save_on_2_ranks_with_group_while_training(four_rank_saves, pair):
    root = os.path.join(four_rank_saves, f"pair{pair}")
    full = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    for i in range(3):
        d = os.path.join(root, f"a{i}")
        report = validate_distributed(d)
        assert report.ok, report.problems
        for world in (1, 2, 3):
            parts = [load_distributed(d, r, world) for r in range(world)]
            assert all(p["step"] == i for p in parts)
            assert torch.equal(torch.cat([p["w"] for p in parts]), full + 1000 * i), (i, world)
    b = load_distributed(os.path.join(root, "b"), 0, 1)
    assert b["step"] == 99 and torch.equal(b["w"], full + 3000)

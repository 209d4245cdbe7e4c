"""The chunked save's compact layout and writer choice, as plain data (no process group).

Properties: for any mesh and Shard / Replicate placements, the predicted boxes
tile the tensor (what lets every rank trust the prediction without an
exchange of boxes); the writes each rank computes for itself are exactly the
ones rank 0's whole plan gives it; every box is written once, by a rank that
holds it; replicated boxes are spread over their holders.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from shardkit.checkpoint import save
from shardkit.checkpoint.planning.compact_layout import (
    Description, MeshInfo, TensorLayout, prediction_trusted, shard_coordinates,
)
from shardkit.checkpoint.planning.dtensor_layout import placement_code
from shardkit.checkpoint.coordination.group import EXCHANGE_OBSERVERS
from shardkit.checkpoint.planning.writer_choice import full_plan, own_writes
from shardkit.comm import Group
from shardkit.errors import CheckpointError, TensorMismatchError
from shardkit.layout import Box, whole_box


@st.composite
def layouts(draw):
    """A description of plain, row and mesh tensors over one or two meshes of one world."""
    world_size = draw(st.integers(1, 8))
    meshes = []
    for _ in range(draw(st.integers(0, 2))):
        dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda d: math.prod(d) <= world_size))
        ranks = draw(st.permutations(range(world_size)))[: math.prod(dims)]
        meshes.append(MeshInfo(tuple(dims), tuple(ranks)))
    tensors = {}
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["plain", "row", "mesh"] if meshes else ["plain", "row"]))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
        if kind == "row":
            tensors[f"r{i}"] = TensorLayout((world_size, *shape[1:]), "F32", "row")
        elif kind == "plain":
            tensors[f"p{i}"] = TensorLayout(shape, draw(st.sampled_from(["F32", "BF16"])), "plain")
        else:
            m = draw(st.integers(0, len(meshes) - 1))
            placements = tuple(draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))]))
                               for _ in meshes[m].shape)
            tensors[f"m{i}"] = TensorLayout(shape, "F32", "mesh", m, placements,
                                            tuple(tuple(placement_code(p)) for p in placements))
    return Description(dict(sorted(tensors.items())), meshes), world_size


def _boxes_of(desc: Description, rank: int, world_size: int) -> dict[str, Box]:
    out = {}
    for name, t in desc.tensors.items():
        if t.kind == "plain":
            out[name] = whole_box(t.full_shape)
        elif t.kind == "row":
            out[name] = Box((rank,) + (0,) * (len(t.full_shape) - 1), (1, *t.full_shape[1:]))
        else:
            out[name] = desc.box(name, desc.meshes[t.mesh].coordinate(rank))
    return out


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_each_rank_computes_its_own_part_of_rank_0s_plan(layout):
    desc, world_size = layout
    ranks = list(range(world_size))
    assert prediction_trusted(desc, ranks)          # Shard / Replicate tile by construction
    plan = full_plan(desc, ranks, world_size)       # checks the tiling itself
    boxes = [_boxes_of(desc, r, world_size) for r in ranks]
    for r in ranks:
        assert sorted(own_writes(desc, r, world_size, r, boxes[r])) == sorted(plan.writes[r]), r
    for name, t in plan.tensors.items():
        assert sum(b.numel for b in t.box_to_writer) == math.prod(desc.tensors[name].full_shape)
        for box, writer in t.box_to_writer.items():
            assert boxes[writer][name] == box, (name, box, writer)     # written by a rank holding it


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_shard_coordinates_give_distinct_boxes_that_tile(mesh_shape, data):
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    placements = tuple(data.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))]))
                       for _ in mesh_shape)
    mesh = MeshInfo(tuple(mesh_shape), tuple(range(math.prod(mesh_shape))))
    desc = Description({"w": TensorLayout(shape, "F32", "mesh", 0, placements)}, [mesh])
    boxes = [desc.box("w", c) for c in shard_coordinates(desc, "w")]
    nonempty = [b for b in boxes if b.numel]
    assert len(set(nonempty)) == len(nonempty)
    assert sum(b.numel for b in nonempty) == math.prod(shape)


def test_replicated_boxes_are_spread_over_their_holders():
    # HSDP on a (2 replicas, 2 shards) mesh, four tensors; ten plain tensors on four ranks
    mesh = MeshInfo((2, 2), (0, 1, 2, 3))
    placements = (Replicate(), Shard(0))
    tensors = {f"m{i}": TensorLayout((8, 4), "F32", "mesh", 0, placements) for i in range(4)}
    tensors.update({f"p{i}": TensorLayout((16 * (i + 1),), "F32", "plain") for i in range(10)})
    plan = full_plan(Description(dict(sorted(tensors.items())), [mesh]), [0, 1, 2, 3], 4)
    mesh_writers = [r for n, t in plan.tensors.items() if n[0] == "m" for r in t.box_to_writer.values()]
    assert sorted(mesh_writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    plain_bytes = [sum(plan.tensors[n].full_shape[0] for n in plan.writes[r] if n[0] == "p") for r in range(4)]
    assert max(plain_bytes) - min(plain_bytes) <= 16 * 10     # at most the largest tensor apart


def test_a_mesh_member_that_does_not_save_is_not_trusted():
    mesh = MeshInfo((4,), (0, 1, 2, 3))
    desc = Description({"w": TensorLayout((8,), "F32", "mesh", 0, (Shard(0),))}, [mesh])
    assert prediction_trusted(desc, [0, 1, 2, 3])
    assert not prediction_trusted(desc, [0, 1, 2])             # rank 3 of the mesh is not saving
    assert not prediction_trusted(desc, [0, 1, 2, 2])          # two saving ranks claim one mesh rank
    assert not prediction_trusted(desc, [0, 1, 2, None])


def _save_on_threads(states, directory):
    """``save`` on ``len(states)`` thread ranks; each rank's (error, collectives issued)."""
    groups = Group.local(len(states))
    counted = [0] * len(states)
    errors = [None] * len(states)

    def observe(rank, collectives, received_bytes, sent_bytes):
        counted[rank] += collectives

    def run(g):
        try:
            save(states[g.rank], directory, group=g)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors[g.rank] = e

    EXCHANGE_OBSERVERS.append(observe)
    try:
        threads = [threading.Thread(target=run, args=(g,), daemon=True) for g in groups]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert not any(t.is_alive() for t in threads), "a rank hung"
    finally:
        EXCHANGE_OBSERVERS.remove(observe)
        closers = [threading.Thread(target=g.close) for g in groups]
        [t.start() for t in closers]
        [t.join(60) for t in closers]
    return errors, counted


@pytest.mark.parametrize("change,match", [
    (lambda s: {**s, "extra": torch.ones(2)}, r"ranks 0 and 1 pass states with different tensors \(differing: extra\)"),
    (lambda s: {**s, "w": torch.ones(5)}, r"tensor 'w' is \[5\] F32 on rank 1 but \[4\] F32 on rank 0"),
    (lambda s: {**s, "w": torch.ones(4, dtype=torch.float64)}, r"tensor 'w' is \[4\] F64 on rank 1"),
])
def test_a_state_that_differs_on_one_rank_gives_the_detailed_error_on_every_rank(tmp_path, change, match):
    state = {"w": torch.ones(4), "b": torch.zeros(2), "step": 3}
    errors, counted = _save_on_threads([state, change(state), state], str(tmp_path / "ck"))
    for e in errors:
        assert isinstance(e, TensorMismatchError) and isinstance(e, CheckpointError), e
        assert __import__("re").search(match, str(e)), str(e)
    # The compact round (a gather and a broadcast), then the full exchange of boxes (2 all-gathers).
    assert counted == [4] * 3
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_an_agreed_state_saves_in_three_rounds_of_a_gather_and_a_broadcast(tmp_path):
    state = {"w": torch.ones(4), "b": torch.zeros(2), "step": 3}
    errors, counted = _save_on_threads([state] * 3, str(tmp_path / "ck"))
    assert errors == [None] * 3
    assert counted == [6] * 3       # prepare, withdraw, write and commit: a gather and a broadcast each


def test_rank_0_refuses_a_file_that_is_not_the_planned_one():
    from shardkit.checkpoint.saving.chunked_save import _check_written, _file_metadata, _header_digest
    from shardkit.errors import MetadataError
    from shardkit.storage import BlockHasher, file_layout

    def record_of(nbytes):
        hasher = BlockHasher(1 << 20)
        hasher.update(memoryview(bytes(nbytes)))
        return hasher.finish().to_json()

    layout = file_layout([("w", "F32", (4,))], _file_metadata(1, 2))
    record = record_of(layout.size_bytes)
    assert _check_written(1, layout, {"record": record, "header": _header_digest(layout)}).bytes == layout.size_bytes
    short = record_of(layout.size_bytes - 4)
    with pytest.raises(MetadataError, match="rank 1 wrote rank_1.safetensors of"):
        _check_written(1, layout, {"record": short, "header": _header_digest(layout)})
    with pytest.raises(MetadataError, match="planned different writes"):
        _check_written(1, layout, {"record": record, "header": "0" * 16})

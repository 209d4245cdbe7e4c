"""Version-3 compact grid entries: the grid planned from a layout, or found from chunks, holds exactly the
chunks of the general encoding, through JSON and back; hostile grids raise ``MetadataError``."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor import Replicate, Shard

from ckpt_helpers import save_full
from shardkit import knobs
from shardkit.checkpoint import load_distributed, validate_distributed
from shardkit.checkpoint.format.chunks import Chunk
from shardkit.checkpoint.planning.compact_layout import Description, MeshInfo, TensorLayout
from shardkit.checkpoint.format.compact_manifest import GridChunks, grid_of_chunks, grid_to_json, parse_grid
from shardkit.checkpoint.planning.dtensor_layout import placement_code
from shardkit.checkpoint.planning.grid_plan import grid_plan
from shardkit.checkpoint.format.grid_split import ChunkSplit, EvenSplit, SizesSplit
from shardkit.checkpoint.format.manifest import manifest_to_json, parse_manifest, read_manifest
from shardkit.checkpoint.planning.writer_choice import full_plan
from shardkit.errors import MetadataError
from shardkit.storage import storage_for
from shardkit.layout import compute_shard_sizes


def _expanded(chunks) -> set:
    return {(c.file, tuple(c.offsets), tuple(c.sizes)) for c in chunks}


def _roundtrip(grid, num_ranks) -> GridChunks:
    raw = json.loads(json.dumps(grid_to_json(grid)))
    return parse_grid("metadata.json", "t", raw, grid.full_shape, num_ranks)


@st.composite
def layouts(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    world = int(np.prod(mesh_shape))
    tensors = {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        kinds = [Replicate()] + [Shard(d) for d in range(len(shape))]
        placements = tuple(draw(st.sampled_from(kinds)) for _ in mesh_shape)
        kind = draw(st.sampled_from(["mesh", "mesh", "plain", "row"]))
        if kind == "row":
            shape = (world, *shape)
        tensors[f"t{i}"] = TensorLayout(shape, draw(st.sampled_from(["F32", "BF16", "I64"])), kind,
                                        0 if kind == "mesh" else -1, placements if kind == "mesh" else (),
                                        tuple(tuple(placement_code(p)) for p in placements) if kind == "mesh" else ())
    ranks = list(range(world))
    if draw(st.booleans()):
        ranks = draw(st.permutations(ranks))
    return Description(dict(sorted(tensors.items())), [MeshInfo(mesh_shape, tuple(ranks))]), world


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_grid_plan_holds_exactly_the_boxes_of_the_full_plan_through_json(layout):
    desc, world = layout
    plan = grid_plan(desc, list(range(world)), world)
    general = full_plan(desc, list(range(world)), world)
    data_bytes = np.zeros(world, dtype=np.int64)
    for name, (shape, dtype, grid) in plan.tensors.items():
        want = {(f"rank_{r}.safetensors", b.offsets, b.sizes) for b, r in general.tensors[name].box_to_writer.items()}
        got = set() if grid is None else _expanded(_roundtrip(grid, world))
        assert got == want, (name, grid)
        for b, r in general.tensors[name].box_to_writer.items():
            data_bytes[r] += b.numel * {"F32": 4, "BF16": 2, "I64": 8}[dtype]
    assert plan.data_bytes.tolist() == data_bytes.tolist()


@st.composite
def uneven_grids(draw):
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=0, max_size=3)))
    per_dim = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        per_dim.append([b - a for a, b in zip([0, *cuts], [*cuts, n])])
    cells = int(np.prod([len(p) for p in per_dim]))
    files = draw(st.permutations(range(cells + draw(st.integers(0, 3)))))[:cells]
    chunks, index = [], 0
    for cell in itertools.product(*(range(len(p)) for p in per_dim)):
        offsets = tuple(sum(p[:i]) for p, i in zip(per_dim, cell))
        sizes = tuple(p[i] for p, i in zip(per_dim, cell))
        chunks.append(Chunk(f"rank_{files[index]}.safetensors", offsets, sizes, 0, 0))
        index += 1
    return shape, chunks, max(files) + 1


@settings(max_examples=150, deadline=None)
@given(uneven_grids())
def test_grid_found_from_chunks_round_trips_them(case):
    shape, chunks, num_ranks = case
    grid = grid_of_chunks(shape, chunks)
    assert grid is not None
    assert _expanded(_roundtrip(grid, num_ranks)) == _expanded(chunks)


def test_splits_match_torch_chunk_and_compute_shard_sizes():
    for n in range(0, 20):
        for k in range(1, 7):
            assert ChunkSplit(n, (k,)).sizes_array().tolist()[:len(torch.arange(n).chunk(k))] == \
                [len(c) for c in torch.arange(n).chunk(k)]
            assert EvenSplit(n, k).sizes_array().tolist() == compute_shard_sizes(n, k)
            s = ChunkSplit(n, (k, 2))
            assert [s.offset(i) for i in range(s.count)] == np.concatenate([[0], np.cumsum(s.sizes_array())[:-1]]).tolist()
            for lo in range(n):
                for hi in range(lo + 1, n + 1):
                    for split in (s, EvenSplit(n, k), SizesSplit(tuple(EvenSplit(n, k).sizes_array().tolist()))):
                        want = [i for i in range(split.count)
                                if split.size(i) and split.offset(i) < hi and lo < split.offset(i) + split.size(i)]
                        assert split.overlapping(lo, hi) == want


def test_non_grids_and_other_files_keep_the_general_list():
    c = lambda f, o, s: Chunk(f, o, s, 0, 0)   # noqa: E731
    l_shape = [c("rank_0.safetensors", (0, 0), (2, 4)), c("rank_1.safetensors", (2, 0), (2, 2)),
               c("rank_2.safetensors", (2, 2), (2, 2))]
    assert grid_of_chunks((4, 4), l_shape) is None
    assert grid_of_chunks((4,), [c("../base/rank_0.safetensors", (0,), (4,))]) is None
    assert grid_of_chunks((0,), []) is None


@pytest.mark.parametrize("raw, match", [
    ({"splits": [{"chunk": [10 ** 12]}], "files": {"first": 0, "steps": [1]}}, "more than|integers"),
    ({"splits": [{"chunk": [4]}], "files": {"first": 0, "steps": [1]}}, None),
    ({"splits": [{"chunk": [4]}], "files": {"first": 1, "steps": [1]}}, "ranks 1..4"),
    ({"splits": [{"chunk": [2, 2]}], "files": {"first": 0, "steps": [0]}}, "two cells"),
    ({"splits": [{"sizes": [1, 2]}], "files": {"first": 0, "steps": [1]}}, "sum"),
    ({"splits": [{"even": 0}], "files": {"first": 0, "steps": [1]}}, "evenly"),
    ({"splits": [{"pad": 3}], "files": {"first": 0, "steps": [1]}}, "kind"),
    ({"splits": [None, None], "files": {"first": 0, "steps": [1]}}, "splits"),
    ({"splits": [{"chunk": [2]}], "files": {"ranks": [0, 0]}}, "ranks"),
    ({"splits": [{"chunk": [2]}], "files": {"ranks": [3]}}, "entries|ranks"),
    ({"splits": [{"chunk": [2]}], "files": {"first": True, "steps": [1]}}, "first"),
])
def test_hostile_grids_raise_metadata_error(raw, match):
    if match is None:
        assert len(parse_grid("m", "t", raw, (8,), 4)) == 4
        return
    with pytest.raises(MetadataError, match=match):
        parse_grid("m", "t", raw, (8,), 4)


@pytest.mark.parametrize("world, dims", [(1, {"w": 0, "b": None}), (5, {"w": 0, "b": None, "v": 1}),
                                         (8, {"w": 1, "b": 0, "v": 0})])
def test_saves_through_the_compact_path_load_and_validate(tmp_path, monkeypatch, world, dims):
    monkeypatch.setattr(knobs, "COMPACT_MIN_RANKS", 1)
    state = {"w": torch.arange(70.0).reshape(10, 7), "b": torch.arange(3, dtype=torch.int64),
             "v": torch.arange(30, dtype=torch.bfloat16).reshape(5, 6), "s": torch.tensor(2.5),
             "e": torch.zeros(0, 3)}
    save_full(state, tmp_path, world, {n: d for n, d in dims.items() if d is not None})
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["format_version"] == 3 and all("grid" in s for n, s in meta["tensor_specs"].items() if n != "e")
    assert validate_distributed(tmp_path).ok
    m = read_manifest(*storage_for(str(tmp_path)))
    assert parse_manifest("again", json.dumps(manifest_to_json(m)).encode()).tensors == m.tensors
    for new_world in (1, 3):
        outs = [load_distributed(tmp_path, rank=r, world_size=new_world) for r in range(new_world)]
        for name, full in state.items():
            if dims.get(name) is not None:
                got = torch.cat([o[name] for o in outs], dim=dims[name])
            else:
                got = outs[0][name]
            assert torch.equal(got, full), name


def test_a_manifest_claiming_too_many_grid_cells_is_refused(monkeypatch):
    grid = {"splits": [{"chunk": [64]}], "files": {"first": 0, "steps": [1]}}
    meta = {"format": "shardkit.distributed", "format_version": 3, "num_ranks": 64,
            "tensor_specs": {f"t{i}": {"full_shape": [64], "dtype": "F32", "grid": grid} for i in range(4)}}
    assert len(parse_manifest("m", json.dumps(meta).encode()).tensors) == 4
    monkeypatch.setattr(knobs, "MAX_GRID_CELLS", 200)
    with pytest.raises(MetadataError, match="256 cells"):
        parse_manifest("m", json.dumps(meta).encode())


def test_rank_0_checks_each_reported_file_against_the_planned_bytes():
    from shardkit.checkpoint.saving.chunked_save import _check_sized
    record = {"bytes": 108, "checksum": "xxh3_64_blocks:" + "0" * 16, "block_bytes": 1 << 20,
              "block_checksums": ["0" * 16]}
    assert _check_sized(1, 100, {"record": record, "header": "x", "data_start": 8}).bytes == 108
    for start in (16, None, 4):
        with pytest.raises(MetadataError, match="planned different writes"):
            _check_sized(1, 100, {"record": record, "header": "x", "data_start": start})


def test_chunks_with_extra_fields_set_keep_the_general_list():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class BaseChunk(Chunk):
        base: str | None = None

    plain = [BaseChunk("rank_0.safetensors", (0,), (2,), 0, 0), BaseChunk("rank_1.safetensors", (2,), (2,), 0, 0)]
    assert grid_of_chunks((4,), plain) is not None
    referenced = [plain[0], BaseChunk("rank_1.safetensors", (2,), (2,), 0, 0, base="../step-100")]
    assert grid_of_chunks((4,), referenced) is None

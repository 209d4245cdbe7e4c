"""load_distributed(..., out=state): in-place loading into tensors the caller already has."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckpt_helpers import bits_equal, rank_slice, save_full
from shardkit import knobs
from shardkit.checkpoint import ShardMetadata, TensorShardSpec, compute_shard_sizes, load_distributed, save_distributed
from shardkit.checkpoint.loading.execute import OpenFiles, run_loads
from shardkit.checkpoint.format.manifest import file_records, read_manifest
from shardkit.checkpoint.planning.plan import plan_load, wanted_box
from shardkit.errors import ChecksumError, TensorMismatchError
from shardkit.storage import storage_for

W = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def _bytes(shape, dtype, seed=0):
    """Random bytes viewed as ``dtype`` (any bit pattern: NaNs too), for bit-for-bit checks."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _nested_state(rank, world_size):
    """A training-like nested state; ``model.w`` is sharded on dim 0, the rest replicated."""
    sizes = compute_shard_sizes(8, world_size)
    return {
        "model": {"w": rank_slice(W, 0, sizes, rank).clone(), "b": torch.arange(3.0)},
        "optim": {"state": {0: {"exp_avg": torch.full((2, 2), 7.0), "step": torch.tensor(5.0)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]},
        "layers": [torch.ones(4), {"scale": torch.tensor(2.5)}],
        "step": 10,
        "name": "run-a",
    }


def _save_nested(directory, world_size):
    spec = ShardMetadata(world_size, {"model.w": TensorShardSpec((8, 6), 0, tuple(compute_shard_sizes(8, world_size)))})
    for rank in range(world_size):  # group=None: each simulated rank on its own
        save_distributed(_nested_state(rank, world_size), directory, rank, world_size, spec)


def _blank(shape_of_w):
    return {
        "model": {"w": torch.zeros(shape_of_w), "b": torch.zeros(3)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(2, 2), "step": torch.tensor(0.0)}},
                  "param_groups": [{"lr": 1.0, "betas": (0.0, 0.0), "params": [0]}]},
        "layers": [torch.zeros(4), {"scale": torch.tensor(0.0)}],
        "step": 0,
        "name": "fresh",
        "mine": {"sched": object(), "best": float("inf")},   # not in the checkpoint: left as is
    }


def _snapshot(state):
    return {k: v.clone() for k, v in _tensors(state).items() if v.device.type != "meta"}  # meta: no data


def _tensors(node, path=""):
    if isinstance(node, torch.Tensor):
        return {path: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else []
    return {k: v for key, child in items for k, v in _tensors(child, f"{path}.{key}" if path else str(key)).items()}


def _assert_unchanged(state, before):
    now = _tensors(state)
    for name, t in before.items():
        assert bits_equal(now[name], t), name


def test_nested_state_filled_in_place(tmp_path):
    _save_nested(tmp_path, 2)
    out = _blank((4, 6))
    tensors_before = _tensors(out)
    ptrs = {n: t.data_ptr() for n, t in tensors_before.items()}
    sched = out["mine"]["sched"]
    assert load_distributed(tmp_path, 1, 2, out=out) is out
    expected = load_distributed(tmp_path, 1, 2)
    for name, t in _tensors(out).items():
        assert t is tensors_before[name] and t.data_ptr() == ptrs[name]   # the same tensors, filled
        assert torch.equal(t, _tensors(expected)[name]), name
    assert out["step"] == 10 and out["name"] == "run-a"
    assert out["optim"]["param_groups"][0]["lr"] == 0.01
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)     # a tuple, rebuilt
    assert out["mine"]["sched"] is sched and out["mine"]["best"] == float("inf")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_reshard_4_to_3_into_out(tmp_path, dim, dtype):
    full, rep = _bytes((10, 7), dtype), _bytes((5,), dtype, seed=1)
    save_full({"w": full, "rep": rep}, tmp_path, 4, {"w": dim})
    sizes = compute_shard_sizes(full.shape[dim], 3)
    for rank in range(3):
        shape = list(full.shape)
        shape[dim] = sizes[rank]
        out = {"w": torch.zeros(shape, dtype=dtype), "rep": torch.zeros(5, dtype=dtype)}
        load_distributed(tmp_path, rank, 3, out=out)
        assert bits_equal(out["w"], rank_slice(full, dim, sizes, rank))
        assert bits_equal(out["rep"], rep)


def test_zero_dim_and_zero_size_tensors(tmp_path):
    state = {"s": torch.tensor(3.5), "e": torch.empty(0, 3), "z": torch.empty(4, 0), "i": torch.tensor(7)}
    save_full(state, tmp_path, 2, {"z": 0, "e": 1})
    out = {"s": torch.tensor(0.0), "e": torch.empty(0, 2), "z": torch.empty(2, 0), "i": torch.tensor(0)}
    load_distributed(tmp_path, 0, 2, out=out)
    assert out["s"].item() == 3.5 and out["i"].item() == 7
    assert out["e"].shape == (0, 2) and out["z"].shape == (2, 0)


@pytest.mark.parametrize("small_io", [False, True], ids=["default-io", "scattered-reads"])
def test_non_contiguous_and_offset_views(tmp_path, monkeypatch, small_io):
    if small_io:  # tiny scratch and staging: scattered reads into given outputs, many staging groups
        monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 24)
        monkeypatch.setattr(knobs, "LOAD_STAGE_BYTES", 16)
    full = _bytes((6, 8), torch.float32)
    save_full({"t": full, "col": full, "row": full}, tmp_path, 3, {"t": 1, "col": 1, "row": 0})
    backing_t, backing_col, backing_row = torch.zeros(8, 6), torch.zeros(6, 9), torch.zeros(10, 8)
    out = {"t": backing_t.t()[:, :4], "col": backing_col[:, 2:6], "row": backing_row[3:6]}
    assert not out["t"].is_contiguous() and not out["col"].is_contiguous() and out["row"].is_contiguous()
    load_distributed(tmp_path, 1, 2, out=out)
    half = compute_shard_sizes(8, 2)
    assert bits_equal(out["t"], rank_slice(full, 1, half, 1)) and bits_equal(out["col"], rank_slice(full, 1, half, 1))
    assert bits_equal(out["row"], full[3:6])
    assert not backing_t[4:].any() and not backing_col[:, :2].any() and not backing_col[:, 6:].any()
    assert not backing_row[:3].any() and not backing_row[6:].any()   # neighbours of the views untouched


def test_keys_with_out_reads_the_intersection(tmp_path):
    _save_nested(tmp_path, 2)
    out = _blank((4, 6))
    before = _snapshot(out)
    load_distributed(tmp_path, 0, 2, keys=["model", "step"], out=out)
    assert torch.equal(out["model"]["w"], W[:4]) and torch.equal(out["model"]["b"], torch.arange(3.0))
    assert out["step"] == 10 and out["name"] == "fresh"            # only selected plain leaves change
    for name in ("optim.state.0.exp_avg", "layers.0", "layers.1.scale"):
        assert bits_equal(_tensors(out)[name], before[name])
    with pytest.raises(TensorMismatchError, match="key 'nope' is not in the checkpoint"):
        load_distributed(tmp_path, 0, 2, keys="nope", out=out)


def test_leaves_out_does_not_name_are_not_added(tmp_path):
    _save_nested(tmp_path, 2)
    out = {"model": {"w": torch.zeros(4, 6)}}
    load_distributed(tmp_path, 0, 2, out=out)
    assert list(out) == ["model"] and list(out["model"]) == ["w"]


@pytest.mark.parametrize("bad, match", [
    ({"model": {"missing": torch.zeros(2)}},
     r"out has a tensor 'model.missing', but the checkpoint has no such tensor; it holds: .*model.w"),
    ({"step": torch.zeros(())}, r"tensor 'step', but the checkpoint holds a plain value"),
    ({"model": {"w": torch.zeros(8, 6)}}, r"'model.w' has shape \[8, 6\], but rank 0 of 2 loads shape \[4, 6\]"),
    ({"model": {"b": torch.zeros(3, dtype=torch.float64)}},
     r"'model.b' is torch.float64, but the checkpoint saved it as torch.float32"),
    ({"model": {"b": torch.zeros(3, device="meta")}}, r"'model.b' is on the meta device"),
    ({"layers": [torch.zeros(4), {"scale": 1.0}]}, r"out's leaf 'layers.1.scale' is not a tensor.*shape \[\]"),
], ids=["missing", "plain-in-checkpoint", "shape", "dtype", "meta", "plain-in-out"])
def test_bad_out_raises_and_leaves_out_untouched(tmp_path, bad, match):
    _save_nested(tmp_path, 2)
    out = _blank((4, 6))
    for key, value in bad.items():   # the bad leaf joins otherwise valid ones, which must stay unwritten
        out[key] = {**out[key], **value} if isinstance(value, dict) else value
    before = _snapshot(out)
    with pytest.raises(TensorMismatchError, match=match):
        load_distributed(tmp_path, 0, 2, out=out)
    _assert_unchanged(out, before)
    assert out["step"] == 0 and out["name"] == "fresh"


def test_corrupt_byte_raises_checksum_error(tmp_path):
    save_full({"w": W}, tmp_path, 2, {"w": 0})
    path = tmp_path / "rank_0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="do not match their checksum"):
        load_distributed(tmp_path, 0, 2, verify=True, out={"w": torch.zeros(4, 6)})
    with pytest.raises(ChecksumError):
        load_distributed(tmp_path, 0, 2, verify=True, out={"w": torch.zeros(6, 4).t()})   # the staged path
    out = {"w": torch.zeros(4, 6)}
    load_distributed(tmp_path, 0, 2, verify=False, out=out)      # verification is optional
    assert not torch.equal(out["w"], W[:4]) and torch.equal(out["w"][:3], W[:3])


def test_parameters_that_require_grad(tmp_path):
    save_full({"weight": W[:, :2].T.contiguous(), "bias": torch.arange(2.0)}, tmp_path, 1, {})
    layer = torch.nn.Linear(8, 2)
    versions = {n: p._version for n, p in layer.named_parameters()}
    load_distributed(tmp_path, 0, 1, out=dict(layer.named_parameters()))
    assert torch.equal(layer.weight.detach(), W[:, :2].T) and torch.equal(layer.bias.detach(), torch.arange(2.0))
    assert all(p.requires_grad and p._version > versions[n] for n, p in layer.named_parameters())


def test_module_state_dict_round_trip(tmp_path):
    src, dst = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    save_distributed({"model": src.state_dict()}, tmp_path, 0, 1, ShardMetadata(1, {}))
    load_distributed(tmp_path, 0, 1, out={"model": dst.state_dict()})
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_seed_format_dtype_comes_from_headers(tmp_path):
    v = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    (tmp_path / "metadata.json").write_text(json.dumps(
        {"num_ranks": 2, "tensor_specs": {"v": {"full_shape": [3, 4], "shard_dim": 1, "shard_sizes": [2, 2]}}}))
    for rank in range(2):
        save_file({"v": v[:, 2 * rank:2 * rank + 2].contiguous()}, str(tmp_path / f"rank_{rank}.safetensors"))
    out = {"v": torch.zeros(3, 4, dtype=torch.float64)}
    load_distributed(tmp_path, 0, 1, out=out)
    assert torch.equal(out["v"], v)
    with pytest.raises(TensorMismatchError, match="torch.float32, but the checkpoint saved it as torch.float64"):
        load_distributed(tmp_path, 0, 1, out={"v": torch.zeros(3, 4)})


def test_seed_format_rank_files_that_disagree_on_dtype_do_not_validate(tmp_path):
    from shardkit.checkpoint import validate_distributed

    v = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    (tmp_path / "metadata.json").write_text(json.dumps(
        {"num_ranks": 2, "tensor_specs": {"v": {"full_shape": [3, 4], "shard_dim": 1, "shard_sizes": [2, 2]}}}))
    save_file({"v": v[:, :2].float().contiguous()}, str(tmp_path / "rank_0.safetensors"))
    save_file({"v": v[:, 2:].contiguous()}, str(tmp_path / "rank_1.safetensors"))
    report = validate_distributed(tmp_path)
    assert not report.ok and "rank_1.safetensors: tensor 'v' is F64, but rank_0.safetensors holds it as F32" in report.problems


def test_out_must_be_a_dict(tmp_path):
    save_full({"w": W}, tmp_path, 1, {})
    with pytest.raises(TypeError, match="out must be a dict"):
        load_distributed(tmp_path, 0, 1, out=[torch.zeros(8, 6)])


def test_run_loads_refuses_an_output_it_cannot_read_into(tmp_path):
    save_full({"w": W}, tmp_path, 1, {})
    storage, directory = storage_for(tmp_path)
    m = read_manifest(storage, directory)
    plans = plan_load(m.tensors, {"w": wanted_box(m.tensors["w"], 1, 0, 1)}, lambda n: 1 << 20)
    with OpenFiles(storage, directory, file_records(storage, directory, m), verify=False) as files:
        given = torch.zeros(8, 6)
        assert run_loads(files, plans, lambda n: torch.float32, {"w": given})["w"].data_ptr() == given.data_ptr()
        assert torch.equal(given, W)
        for bad in (torch.zeros(6, 8).t(), torch.zeros(8, 5), torch.zeros(8, 6, dtype=torch.float64)):
            with pytest.raises(TensorMismatchError, match="reading straight into it needs a contiguous CPU"):
                run_loads(files, plans, lambda n: torch.float32, {"w": bad})


@pytest.mark.gpu
def test_cuda_out_is_filled_through_a_staging_copy(tmp_path):
    save_full({"w": W}, tmp_path, 2, {"w": 0})
    out = {"w": torch.zeros(3, 6, device="cuda"), "t": None}
    load_distributed(tmp_path, 1, 3, device="cpu", out=out)   # device= is ignored with out
    assert out["w"].device.type == "cuda" and torch.equal(out["w"].cpu(), W[3:6])


@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    return (shape, draw(st.integers(0, ndim - 1)), draw(st.integers(1, 4)), draw(st.integers(1, 4)),
            draw(st.booleans()), draw(st.integers(0, 2**16)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_property_out_equals_the_returned_slices(tmp_path_factory, monkeypatch, case):
    shape, dim, n, m, transposed, seed = case
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 24)
    directory = tmp_path_factory.mktemp("into")
    full = _bytes(shape, torch.bfloat16, seed)
    save_full({"w": full}, directory, n, {"w": dim})
    for rank in range(m):
        expected = load_distributed(directory, rank, m)["w"]
        target = torch.zeros(tuple(reversed(expected.shape)), dtype=torch.bfloat16).permute(
            *reversed(range(len(shape)))) if transposed else torch.zeros(expected.shape, dtype=torch.bfloat16)
        load_distributed(directory, rank, m, out={"w": target})
        assert bits_equal(target.contiguous(), expected)


@pytest.mark.parametrize("world_size", [1, 2])
def test_tied_leaves_of_out_are_read_once_from_the_first_name(tmp_path, monkeypatch, world_size):
    # Saved untied (two different tensors); out ties them, as a tied model's state_dict() does.
    embed, head = _bytes((8, 6), torch.float32, seed=3), _bytes((8, 6), torch.float32, seed=4)
    save_full({"embed": embed, "head": head}, tmp_path, world_size, {})
    monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 16)  # many small reads: a race between the two would show
    w = torch.zeros(8, 6)
    out = {"embed": w, "head": w}
    load_distributed(tmp_path, 0, 1, out=out)
    assert out["head"] is w and bits_equal(w, embed)


def test_leaves_of_out_that_overlap_are_filled_one_after_the_other(tmp_path):
    whole, part = _bytes((8, 6), torch.float32, seed=5), _bytes((2, 6), torch.float32, seed=6)
    save_full({"whole": whole, "part": part}, tmp_path, 2, {"whole": 0})
    buf = torch.zeros(8, 6)
    load_distributed(tmp_path, 0, 1, out={"whole": buf, "part": buf[1:3]})  # in out's order: part last
    expected = whole.clone()
    expected[1:3] = part
    assert bits_equal(buf, expected)


def test_run_loads_refuses_outputs_over_one_memory(tmp_path):
    save_full({"a": W, "b": W + 1}, tmp_path, 1, {})
    storage, directory = storage_for(tmp_path)
    m = read_manifest(storage, directory)
    w = torch.zeros(8, 6)
    with OpenFiles(storage, directory, file_records(storage, directory, m), verify=False) as files:
        plans = plan_load(m.tensors, {n: wanted_box(m.tensors[n], 1, 0, 1) for n in ("a", "b")}, lambda n: 1 << 20)
        with pytest.raises(TensorMismatchError, match="same memory"):
            run_loads(files, plans, lambda n: torch.float32, {"a": w, "b": w})
    assert not w.any()

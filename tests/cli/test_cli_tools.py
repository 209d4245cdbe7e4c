"""shardkit reshard / convert / diff with good and bad inputs.

End to end in a subprocess (``shardkit``): one happy path and one bad input per subcommand, the kill
midway through a reshard and the malicious DCP pickle. Every other case goes through
``shardkit.cli.main`` in this process (``in_process``: same code, same exit codes and messages,
no interpreter start or torch import per case).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from cli_helpers import (assert_one_line_error, dcp_save_rank, dcp_state, in_process, save_sharded, shardkit,
                         training_state)
from ranks import run_ranks
from shardkit.checkpoint import (load_consolidated, load_distributed, read_metadata, save_distributed,
                                 validate_distributed)
from shardkit.errors import MetadataError
from shardkit.sources import DcpCheckpoint, open_source, read_dcp_metadata


@pytest.fixture
def ckpt(tmp_path):
    return save_sharded(training_state(), tmp_path / "ck")


# -- reshard --------------------------------------------------------------------------------------


def split_of(saved) -> tuple:
    """``(dimension, sizes)`` of a tensor written (format 2) as chunks along one dimension, in order."""
    full = saved.spec.full_shape
    dims = {d for c in saved.chunks for d, (size, whole) in enumerate(zip(c.box.sizes, full)) if size != whole}
    assert len(dims) == 1, dims
    dim = dims.pop()
    return dim, tuple(c.box.sizes[dim] for c in sorted(saved.chunks, key=lambda c: c.box.offsets[dim]))

def test_reshard_writes_a_valid_checkpoint_for_the_new_world(ckpt, tmp_path):
    code, out, err = shardkit("reshard", ckpt, tmp_path / "ws3", "--world-size", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["to_ranks"] == 3
    assert validate_distributed(str(tmp_path / "ws3")).ok
    assert split_of(read_metadata(str(tmp_path / "ws3")).tensors["model.w"]) == (0, (3, 3, 2))
    state = training_state()
    assert load_distributed(str(tmp_path / "ws3"), 2, 3)["model"]["w"].equal(state["model"]["w"][6:])
    whole = load_consolidated(str(tmp_path / "ws3"))
    assert whole["optim"]["w_m"].equal(state["optim"]["w_m"]) and whole["step"] == 3


def test_reshard_bad_inputs_one_line_exit_2_and_an_incomplete_source_exit_1(ckpt, tmp_path):
    assert_one_line_error(*shardkit("reshard", tmp_path / "nope", tmp_path / "o", "--world-size", "2"))
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*in_process("reshard", tmp_path / "empty", tmp_path / "o", "--world-size", "2"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert "convert" in assert_one_line_error(*in_process("reshard", tmp_path / "hf", tmp_path / "o", "--world-size", "2"))
    os.remove(ckpt / "metadata.json")
    line = assert_one_line_error(*in_process("reshard", ckpt, tmp_path / "o", "--world-size", "2"), expected_code=1)
    assert "never finished" in line
    assert not (tmp_path / "o").exists()


def test_reshard_refuses_an_existing_destination_and_bad_world(ckpt, tmp_path):
    (tmp_path / "taken").mkdir()
    assert "already exists" in assert_one_line_error(*in_process("reshard", ckpt, tmp_path / "taken", "--world-size", "2"))
    assert_one_line_error(*in_process("reshard", ckpt, tmp_path / "o", "--world-size", "0"))
    code, _, err = in_process("reshard", ckpt)  # argparse usage error
    assert code == 2 and "Traceback" not in err


def test_reshard_of_a_corrupt_checkpoint_publishes_nothing(ckpt, tmp_path):
    data = bytearray((ckpt / "rank_1.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (ckpt / "rank_1.safetensors").write_bytes(bytes(data))
    # every source block is verified as it is read: a flipped byte is refused, never carried over
    # under fresh checksums, and nothing is published
    line = assert_one_line_error(*in_process("reshard", ckpt, tmp_path / "o", "--world-size", "3"), expected_code=1)
    assert "rank_1.safetensors" in line and "checksum" in line
    assert not (tmp_path / "o").exists()
    assert not any(p.name.startswith(".o.partial") for p in tmp_path.iterdir())


KILL_MIDWAY = """
import os, signal, sys
import shardkit.checkpoint.saving.chunked_save as w   # the save engine the offline writers write through
real = w.write_safetensors
calls = []
def dying(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
w.write_safetensors = dying
from shardkit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_reshard_killed_midway_leaves_no_destination_that_validates(ckpt, tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, "reshard", str(ckpt), str(dst), "--world-size", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9
    assert not dst.exists()
    assert not validate_distributed(str(dst)).ok
    code, _, err = in_process("reshard", ckpt, dst, "--world-size", "3")  # a leftover partial dir does not block it
    assert code == 0, err
    assert validate_distributed(str(dst)).ok


def test_reshard_to_the_same_world_size_evens_out_an_uneven_split(tmp_path):
    from shardkit.checkpoint import ShardMetadata, TensorShardSpec

    w = torch.arange(20.0).reshape(5, 4)
    spec = ShardMetadata(2, {"w": TensorShardSpec((5, 4), 0, (4, 1))})
    for rank, rows in ((1, w[4:]), (0, w[:4])):
        save_distributed({"w": rows}, tmp_path / "uneven", rank, 2, spec)
    code, _, err = in_process("reshard", tmp_path / "uneven", tmp_path / "even", "--world-size", "2")
    assert code == 0, err
    assert split_of(read_metadata(str(tmp_path / "even")).tensors["w"]) == (0, (3, 2))
    assert load_consolidated(str(tmp_path / "even"))["w"].equal(w)


def _save_dtensor_rank(rank, world_size, path):
    """shardkit.checkpoint.save of a DTensor sharded on dim 1 over 3 Gloo ranks (format 2: chunks)."""
    import shardkit.checkpoint as ckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    ckpt.save({"w": distribute_tensor(torch.arange(24.0).reshape(2, 12), mesh, [Shard(1)]), "b": torch.ones(3)}, path)
    return True


def test_reshard_of_a_dtensor_checkpoint_re_splits_its_chunks(tmp_path):
    run_ranks(_save_dtensor_rank, 3, tmp_path, str(tmp_path / "v2"))
    assert len(read_metadata(str(tmp_path / "v2")).tensors["w"].chunks) == 3
    code, _, err = in_process("reshard", tmp_path / "v2", tmp_path / "ws2", "--world-size", "2")
    assert code == 0, err
    assert split_of(read_metadata(str(tmp_path / "ws2")).tensors["w"]) == (1, (6, 6))  # split again, not whole
    assert load_consolidated(str(tmp_path / "ws2"))["w"].equal(torch.arange(24.0).reshape(2, 12))


# -- convert --------------------------------------------------------------------------------------

def test_convert_to_hf_exports_the_model_subtree(ckpt, tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "toy"}')
    code, out, err = shardkit("convert", ckpt, tmp_path / "hf", "--to", "hf", "--dtype", "bf16", "--config", config)
    assert code == 0, err
    from shardkit.hf import load_checkpoint

    loaded = load_checkpoint(str(tmp_path / "hf"))
    state = training_state()
    assert set(loaded) == {"w", "b", "ids"}  # prefix stripped, optimizer left out
    assert loaded["w"].dtype == torch.bfloat16 and loaded["ids"].dtype == torch.int64
    assert loaded["w"].equal(state["model"]["w"].to(torch.bfloat16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "toy"}


def test_convert_to_hf_keeps_a_causal_lm_whole_and_a_prefix_is_a_subtree(tmp_path):
    # model.* beside lm_head.weight is a Hugging Face model's own naming: nothing may be dropped or renamed
    from shardkit.hf import load_checkpoint

    state = {"model": {"embed": torch.randn(4, 3), "norm": torch.ones(3)}, "lm_head": {"weight": torch.randn(4, 3)}}
    src = tmp_path / "lm"
    save_distributed(state, src, 0, 1, None)
    assert in_process("convert", src, tmp_path / "hf", "--to", "hf", "-q")[0] == 0
    loaded = load_checkpoint(str(tmp_path / "hf"))
    assert set(loaded) == {"model.embed", "model.norm", "lm_head.weight"}
    assert loaded["lm_head.weight"].equal(state["lm_head"]["weight"])
    assert in_process("convert", src, tmp_path / "sub", "--to", "hf", "--prefix", "model", "-q")[0] == 0
    assert set(load_checkpoint(str(tmp_path / "sub"))) == {"embed", "norm"}  # "model" means "model."


def test_convert_to_distributed_keeps_a_distributed_source_s_nesting_and_user_metadata(tmp_path):
    state = {"model": {"w": torch.randn(3, 2)}, "opt": {"groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}, "step": 4}
    save_distributed(state, tmp_path / "src", 0, 1, None, metadata={"run": "exp-7"})
    code, _, err = in_process("convert", tmp_path / "src", tmp_path / "dst", "--to", "distributed", "-q")
    assert code == 0, err
    back = load_consolidated(str(tmp_path / "dst"))
    assert back["opt"]["groups"][0]["betas"] == [0.9, 0.99] and back["step"] == 4 and back["model"]["w"].equal(state["model"]["w"])
    assert read_metadata(str(tmp_path / "dst")).user_metadata == {"run": "exp-7"}


def test_convert_takes_a_max_shard_size_in_plain_bytes(ckpt, tmp_path):
    code, _, err = in_process("convert", ckpt, tmp_path / "hf", "--to", "hf", "--max-shard-size", "100", "-q")
    assert code == 0, err
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1


def test_convert_roundtrip_hf_to_distributed(ckpt, tmp_path):
    assert in_process("convert", ckpt, tmp_path / "hf", "--to", "hf", "--prefix", "", "-q")[0] == 0
    code, _, err = in_process("convert", tmp_path / "hf", tmp_path / "back", "--to", "distributed")
    assert code == 0, err
    code, out, _ = in_process("diff", ckpt, tmp_path / "back", "--json")
    report = json.loads(out)
    assert code == 1 and all(t["status"] == "identical" for t in report["tensors"])
    assert report["values"] == {"step": [3, None]}  # an HF export keeps tensors only


def test_convert_bad_inputs(ckpt, tmp_path):
    assert_one_line_error(*shardkit("convert", tmp_path / "nope", tmp_path / "o", "--to", "hf"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    assert "not a checkpoint" in assert_one_line_error(*in_process("convert", tmp_path / "junk", tmp_path / "o", "--to", "hf"))
    assert_one_line_error(*in_process("convert", ckpt, tmp_path / "o", "--to", "hf", "--prefix", "nothing."))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(*in_process("convert", tmp_path / "hf", tmp_path / "o", "--to", "distributed"), expected_code=1)
    assert not (tmp_path / "o").exists()


# -- DCP ------------------------------------------------------------------------------------------

def _dcp_save_one(path):
    import torch.distributed.checkpoint as dcp

    state = dcp_state()
    dcp.save({**state, "step": 7}, checkpoint_id=str(path), no_dist=True)
    return state


def _flip_in_dcp_record(path, name):
    """Flip one byte inside the stored bytes of ``name``'s first chunk (the tensor data, not the zip framing)."""
    from shardkit.sources.dcp_record import tensor_data_span

    with DcpCheckpoint(str(path)) as ck:
        chunk = ck.tensors[name].chunks[0]
        with open(path / chunk.file_name, "rb") as f:
            f.seek(chunk.offset)
            record = f.read(chunk.length)
        import io

        start, length, _ = tensor_data_span(io.BytesIO(record), ck.tensors[name].dtype, chunk.box.sizes)
    with open(path / chunk.file_name, "r+b") as f:
        f.seek(chunk.offset + start + length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_in_a_dcp_record_is_caught_by_its_crc(tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    _flip_in_dcp_record(tmp_path / "dcp", "model.w")
    code, out, err = in_process("validate", tmp_path / "dcp")
    assert code == 1 and "CRC-32" in out + err
    code, _, err = in_process("convert", tmp_path / "dcp", tmp_path / "dist", "--to", "distributed")
    assert code == 1 and "CRC-32" in err and not (tmp_path / "dist").exists()
    with DcpCheckpoint(str(tmp_path / "dcp")) as ck:
        assert ck.read("model.b").dtype == torch.bfloat16  # the other records still read


def test_dcp_values_keep_tuples_and_a_damaged_value_is_an_error_not_a_gap(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({**dcp_state(), "betas": (0.9, 0.999)}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    dcp.save({**dcp_state(), "betas": (0.5, 0.5)}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    with open_source(str(tmp_path / "a")) as src:
        assert list(src.objects()["betas"]) == [0.9, 0.999]
    code, out, _ = in_process("diff", tmp_path / "a", tmp_path / "b")
    assert code == 1 and "betas" in out
    with DcpCheckpoint(str(tmp_path / "a")) as ck:
        chunk = ck.values["betas"]
    with open(tmp_path / "a" / chunk.file_name, "r+b") as f:  # damage the value's record
        f.seek(chunk.offset + chunk.length - 30)
        f.write(b"\xff" * 8)
    code, _, err = in_process("convert", tmp_path / "a", tmp_path / "dist", "--to", "distributed")
    assert code == 1 and "betas" in err and not (tmp_path / "dist").exists()


def _set(attr, value):
    return lambda md: [setattr(c, attr, value) for c in md.state_dict_metadata["model.w"].chunks]


DCP_MALFORMED = {
    "chunk offsets None": _set("offsets", None),
    "chunk sizes a string": _set("sizes", "12"),
    "dtype a string": lambda md: setattr(md.state_dict_metadata["model.w"].properties, "dtype", "float32"),
    "properties None": lambda md: setattr(md.state_dict_metadata["model.w"], "properties", None),
    "size negative": lambda md: setattr(md.state_dict_metadata["model.w"], "size", [-1, 6]),
    "storage offset None": lambda md: [setattr(v, "offset", None) for v in md.storage_data.values()],
}


@pytest.mark.parametrize("damage", list(DCP_MALFORMED))
def test_a_malformed_dcp_metadata_is_a_typed_error_in_every_tool(tmp_path, damage):
    _dcp_save_one(tmp_path / "dcp")
    path = tmp_path / "dcp" / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)  # the test's own file: trusted
    DCP_MALFORMED[damage](md)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    for command in ("inspect", "validate"):
        code, out, err = in_process(command, tmp_path / "dcp")
        assert code in (1, 2) and "internal error" not in err, (command, code, out, err)


def test_dcp_import_of_a_one_process_save_equals_the_state(tmp_path):
    state = _dcp_save_one(tmp_path / "dcp")
    code, out, err = in_process("convert", tmp_path / "dcp", tmp_path / "dist", "--to", "distributed", "--json")
    assert code == 0, err
    assert json.loads(out)["from"] == "dcp"
    loaded = load_consolidated(str(tmp_path / "dist"))
    assert set(loaded) == set(state) | {"step"} and loaded["step"] == 7
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and loaded[name].equal(t)


@pytest.mark.multiproc
def test_dcp_import_of_a_two_rank_gloo_save_equals_the_state(tmp_path):
    path = str(tmp_path / "dcp2")
    run_ranks(dcp_save_rank, 2, tmp_path, path)
    with DcpCheckpoint(path) as ck:
        assert len(ck.tensors["model.w"].chunks) == 2          # saved in chunks, assembled on read
        assert ck.read_box("model.w", (3, 1), (4, 2)).equal(dcp_state()["model.w"][3:7, 1:3])
    assert in_process("convert", path, tmp_path / "hf", "--to", "hf", "--prefix", "")[0] == 0
    from shardkit.hf import load_checkpoint

    loaded = load_checkpoint(str(tmp_path / "hf"))
    for name, t in dcp_state().items():
        assert loaded[name].equal(t)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_dcp_metadata_that_carries_code_is_refused_and_never_runs(tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(MetadataError):
        read_dcp_metadata(str(tmp_path / "dcp"))
    line = assert_one_line_error(*shardkit("convert", tmp_path / "dcp", tmp_path / "o", "--to", "hf"), expected_code=1)
    assert "restricted unpickler" in line
    assert "restricted unpickler" in assert_one_line_error(*in_process("diff", tmp_path / "dcp", tmp_path / "dcp"))
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_dcp_incomplete_and_corrupt(tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    data = (tmp_path / "dcp" / ".metadata").read_bytes()
    (tmp_path / "dcp" / ".metadata").write_bytes(data[: len(data) // 2])
    assert_one_line_error(*in_process("diff", tmp_path / "dcp", tmp_path / "dcp"))
    os.remove(tmp_path / "dcp" / ".metadata")
    assert "never finished" in assert_one_line_error(*in_process("convert", tmp_path / "dcp", tmp_path / "o", "--to", "hf"),
                                                     expected_code=1)


@pytest.mark.parametrize("chunks", [
    [((0,), (2,)), ((1,), (2,))],          # overlap, and element 3 in no chunk: a read left it unset
    [((0,), (2,)), ((2,), (1,))],          # a gap
    [((0,), (2,)), ((2,), (3,))],          # past the end
    [((0, 0), (2, 1)), ((2,), (2,))],      # the wrong number of dimensions
])
def test_dcp_chunks_that_do_not_cover_the_tensor_exactly_are_refused(tmp_path, chunks):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    path = tmp_path / "dcp" / ".metadata"
    meta = pickle.loads(path.read_bytes())
    (info,) = meta.storage_data.values()
    entry = meta.state_dict_metadata["w"]
    entry.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    meta.storage_data = {MetadataIndex("w", torch.Size(o)): info for o, _ in chunks}
    path.write_bytes(pickle.dumps(meta))
    with pytest.raises(MetadataError, match="cover its shape"):
        DcpCheckpoint(str(tmp_path / "dcp"))


def test_dcp_truncated_data_file_is_refused(tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    (distcp,) = [p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp"]
    distcp.write_bytes(distcp.read_bytes()[:100])
    assert "truncated" in assert_one_line_error(*in_process("convert", tmp_path / "dcp", tmp_path / "o", "--to", "hf"),
                                                expected_code=1)


# -- diff -----------------------------------------------------------------------------------------

def test_diff_identical_from_checksums(ckpt, tmp_path):
    other = save_sharded(training_state(), tmp_path / "same")
    code, out, err = shardkit("diff", ckpt, other, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["identical"] and all(t["how"] == "checksum" for t in report["tensors"])


def test_diff_says_what_it_trusted_and_verify_reads_a_damaged_copy(tmp_path, monkeypatch):
    import shutil

    from shardkit import knobs

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 4096)  # the damage lies past the header's block
    save_distributed({"big": torch.randn(8192)}, tmp_path / "orig", 0, 1, None)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    data = tmp_path / "copy" / "rank_0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-2] ^= 0xFF  # damaged after it was saved: its recorded checksums still match the original's
    data.write_bytes(bytes(raw))
    code, out, _ = in_process("diff", tmp_path / "orig", tmp_path / "copy")
    assert code == 0 and "from recorded checksums, bytes not read: --verify reads them" in out
    code, out, err = in_process("diff", tmp_path / "orig", tmp_path / "copy", "--verify")
    assert code == 2 and "rank_0.safetensors" in err and "checksum" in err


def test_diff_of_fp8_nan_and_swapped_dtypes(tmp_path):
    from shardkit.offline import diff_checkpoints
    from shardkit.hf import save_checkpoint

    f8 = torch.tensor([1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
    save_checkpoint(str(tmp_path / "a"), {"f8": f8, "i": torch.tensor([1, 2, 3]), "n": torch.tensor([float("nan"), -0.0])},
                    safetensors=True)
    save_checkpoint(str(tmp_path / "b"), {"f8": torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e4m3fn),
                                          "i": torch.tensor([1.9, 2.9, 3.9]), "n": torch.tensor([float("nan"), 0.0])},
                    safetensors=True)
    ab = {t.name: t for t in diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b")).tensors}
    ba = {t.name: t for t in diff_checkpoints(str(tmp_path / "b"), str(tmp_path / "a")).tensors}
    assert ab["f8"].status == "different" and ab["f8"].max_abs == 444.0
    assert ab["n"].status == "identical"  # NaN where the other has NaN, -0.0 equal to 0.0
    assert ab["i"].status == ba["i"].status == "dtype" and ab["i"].max_abs == pytest.approx(ba["i"].max_abs)
    assert ab["i"].max_abs == pytest.approx(0.9)


def test_diff_changed_reshaped_redtyped(ckpt, tmp_path):
    state = training_state()
    state["model"]["b"] = state["model"]["b"] + 0.5
    state["optim"]["w_m"] = state["optim"]["w_m"].to(torch.float64)
    state["model"]["ids"] = torch.arange(7)
    state["model"]["extra"] = torch.zeros(2)
    other = save_sharded(state, tmp_path / "other")
    code, out, err = in_process("diff", ckpt, other, "--json")
    assert code == 1, err
    report = json.loads(out)
    by_name = {t["name"]: t for t in report["tensors"]}
    assert by_name["model.b"]["status"] == "different" and by_name["model.b"]["max_abs"] == pytest.approx(0.5)
    assert by_name["optim.w_m"]["status"] == "dtype" and by_name["optim.w_m"]["max_abs"] < 1e-6
    assert by_name["model.ids"]["status"] == "shape"
    assert by_name["model.w"]["status"] == "identical"
    assert report["only_in_b"] == ["model.extra"] and report["only_in_a"] == []
    code, out, _ = in_process("diff", ckpt, other)
    assert code == 1 and "model.extra" in out and "values differ" in out


def test_diff_across_kinds(ckpt, tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    assert in_process("convert", tmp_path / "dcp", tmp_path / "hf", "--to", "hf", "--prefix", "")[0] == 0
    code, out, err = in_process("diff", tmp_path / "dcp", tmp_path / "hf")
    assert code == 1 and "step" in out  # the DCP side keeps a plain value the HF export does not
    code, _, _ = in_process("diff", tmp_path / "hf", tmp_path / "hf")
    assert code == 0


def test_a_directory_with_both_manifests_is_the_same_kind_to_every_tool(ckpt, tmp_path):
    import shutil

    from shardkit.sources import detect_kind

    mixed = tmp_path / "mixed"
    shutil.copytree(ckpt, mixed)
    from shardkit.hf import save_checkpoint

    save_checkpoint(str(tmp_path / "hf"), {"x": torch.zeros(2)}, safetensors=True)
    for name in os.listdir(tmp_path / "hf"):
        shutil.copy(tmp_path / "hf" / name, mixed / name)
    assert detect_kind(str(mixed)) == "distributed"
    code, out, err = in_process("diff", mixed, ckpt)
    assert code == 0, (out, err)


def test_a_dcp_with_a_nan_value_is_identical_to_itself(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({**dcp_state(), "loss": float("nan")}, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    code, out, err = in_process("diff", tmp_path / "a", tmp_path / "a")
    assert code == 0, (out, err)


def test_diff_bad_inputs(ckpt, tmp_path):
    assert_one_line_error(*shardkit("diff", ckpt, tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    assert_one_line_error(*in_process("diff", tmp_path / "file", ckpt))


def test_open_source_lists_without_reading(ckpt):
    with open_source(str(ckpt)) as src:
        infos = src.tensors()
    assert infos["model.w"].shape == (8, 4) and infos["model.w"].checksum


def test_verbose_logs_through_shardkit_loggers(ckpt, tmp_path):
    code, _, err = in_process("reshard", ckpt, tmp_path / "o", "--world-size", "3", "-v")
    assert code == 0 and "shardkit.offline: resharding" in err


def test_inspect_and_validate_read_a_dcp_checkpoint(tmp_path):
    state = _dcp_save_one(tmp_path / "dcp")
    code, out, err = in_process("inspect", tmp_path / "dcp", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["kind"] == "dcp" and summary["objects"] == {"step": 7}
    assert {r["name"]: r["shape"] for r in summary["tensors"]} == {n: list(t.shape) for n, t in state.items()}
    code, out, _ = in_process("validate", tmp_path / "dcp")
    assert code == 0 and out.strip() == f"{tmp_path / 'dcp'}: ok"


def test_validate_reports_a_broken_dcp_checkpoint_and_never_runs_its_pickle(tmp_path):
    _dcp_save_one(tmp_path / "dcp")
    (distcp,) = [p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp"]
    distcp.write_bytes(distcp.read_bytes()[:100])
    code, out, _ = in_process("validate", tmp_path / "dcp")
    assert code == 1 and "truncated" in out
    os.remove(tmp_path / "dcp" / ".metadata")
    code, out, _ = in_process("validate", tmp_path / "dcp")
    assert code == 1 and "never finished" in out
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    code, out, _ = in_process("validate", tmp_path / "dcp")
    assert code == 1 and "restricted unpickler" in out
    assert in_process("inspect", tmp_path / "dcp")[0] == 1
    assert not marker.exists()

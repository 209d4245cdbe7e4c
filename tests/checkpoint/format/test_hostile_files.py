"""Hostile or damaged distributed-checkpoint files: one regression test per class an attacker found.

Every reader (``hostile_helpers.READERS``: read_metadata, load_distributed with and
without ``out=``, load_region, load_consolidated, reshard) must raise a shardkit
error, never a raw one, never hang, and never allocate out of proportion to the
real files; ``validate_distributed`` must report problems and never raise. Each
case runs in a forked child with a hang guard and a peak-memory measurement.
"""

import json
import os

import pytest
import torch

from hostile_helpers import (
    guarded,
    read_json,
    read_safetensors,
    refresh_record,
    run_readers,
    save_small,
    untyped,
    write_json,
    write_safetensors_raw,
)
from shardkit.checkpoint import load_consolidated, load_distributed, reshard, validate_distributed
from shardkit.errors import MetadataError, MissingShardError
from shardkit.storage.json_io import json_depth

MiB = 1 << 20
#: Peak memory growth allowed beyond the files' sizes (Python objects, scratch, torch's first allocations).
BUDGET_BYTES = 64 * MiB


@pytest.fixture()
def ckpt(tmp_path):
    save_small(tmp_path)
    return tmp_path


def _all_fail_typed(directory, *, timeout_s=60.0, expect_problem=True):
    outcome = guarded(lambda: run_readers(directory), timeout_s=timeout_s)
    assert not outcome.hung, "a reader hung"
    assert outcome.error is None, outcome.message
    results = outcome.value
    assert untyped(results) == {}, untyped(results)
    failed = [name for name, (error, _, _) in results.items() if error is not None]
    if expect_problem:
        assert results["validate"][2], "validate_distributed found nothing wrong"
        assert failed, "no reader noticed"
    assert outcome.peak_growth_bytes < BUDGET_BYTES + _dir_bytes(directory), outcome.peak_growth_bytes
    return results


def _dir_bytes(directory):
    total = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def _edit(path, fn):
    obj = read_json(path)
    fn(obj)
    write_json(path, obj)


# --- raw exceptions ----------------------------------------------------------------------------------------------

def test_deeply_nested_json_everywhere(ckpt):
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = (ckpt / "metadata.json").read_bytes()
    (ckpt / "metadata.json").write_bytes(raw.replace(b'"user_metadata": {}', b'"user_metadata": {"x": ' + deep + b"}"))
    results = _all_fail_typed(ckpt)
    assert "nests arrays/objects 100002 deep" in results["read_metadata"][2]
    assert json_depth(b'{"a": "[[[[", "b": [["\\"[["]]}') == 3


def test_deeply_nested_rank_manifest_and_header(ckpt):
    (ckpt / "rank_1.json").write_bytes(b'{"files": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    header, data = read_safetensors(ckpt / "rank_0.safetensors")
    text = json.dumps(header).replace('"F32"', "[" * 5000 + "]" * 5000, 1).encode()
    write_safetensors_raw(ckpt / "rank_0.safetensors", text, data)
    refresh_record(ckpt, 0)
    _all_fail_typed(ckpt)


@pytest.mark.parametrize("literal", [b"9" * 5000, b"Infinity", b"-Infinity", b"NaN", b"1e400", b"2.5"])
@pytest.mark.parametrize("where", ["num_ranks", "full_shape", "shard_sizes", "block_bytes", "bytes"])
def test_huge_nonfinite_and_float_numbers(ckpt, literal, where):
    raw = (ckpt / "metadata.json").read_bytes()
    target = {"num_ranks": b'"num_ranks": 2', "full_shape": b'"full_shape": [4',
              "shard_sizes": b'"shard_sizes": [2', "block_bytes": b'"block_bytes": 8388608',
              "bytes": b'"bytes": '}[where]
    assert target in raw
    damaged = raw.replace(target, target.rstrip(b"0123456789") + literal, 1) if where != "bytes" else \
        raw.replace(target, target + literal + b", \"was\": ", 1)
    (ckpt / "metadata.json").write_bytes(damaged)
    results = _all_fail_typed(ckpt)
    assert results["read_metadata"][0] == "MetadataError"


def test_huge_number_in_header_shape(ckpt):
    header, data = read_safetensors(ckpt / "rank_1.safetensors")
    text = json.dumps(header).replace('"shape": [2, 3]', '"shape": [2, ' + "9" * 5000 + "]").encode()
    write_safetensors_raw(ckpt / "rank_1.safetensors", text, data)
    refresh_record(ckpt, 1)
    results = _all_fail_typed(ckpt, expect_problem=False)
    assert results["load_distributed(1 of 2)"][0] == "MetadataError"
    assert any("rank_1.safetensors" in p for p in results["validate"][2])


WRONG_TYPES = {
    "tensor_specs is a list": lambda o: o.update(tensor_specs=[1, 2]),
    "spec is a string": lambda o: o["tensor_specs"].update({"model.w": "x"}),
    "full_shape is a string": lambda o: o["tensor_specs"]["model.w"].update(full_shape="abc"),
    "full_shape holds null": lambda o: o["tensor_specs"]["model.w"].update(full_shape=[None, 3]),
    "shard_dim is a string": lambda o: o["tensor_specs"]["model.w"].update(shard_dim="0"),
    "shard_sizes is an object": lambda o: o["tensor_specs"]["model.w"].update(shard_sizes={"a": 1}),
    "dtype is a list": lambda o: o["tensor_specs"]["model.w"].update(dtype=["F32"]),
    "owner_rank is true": lambda o: o["tensor_specs"]["model.b"].update(owner_rank=True),
    "files is a list": lambda o: o.update(files=["rank_0.safetensors"]),
    "record is a list": lambda o: o["files"].update({"rank_0.safetensors": [1]}),
    "block_checksums is a string": lambda o: o["files"]["rank_0.safetensors"].update(block_checksums="ab"),
    "checksum is a number": lambda o: o["files"]["rank_0.safetensors"].update(checksum=5),
    "bytes is a string": lambda o: o["files"]["rank_0.safetensors"].update(bytes="240"),
    "objects is a list": lambda o: o.update(objects=[1]),
    "object is a dict": lambda o: o["objects"].update(step={"a": 1}),
    "save_id is a number": lambda o: o.update(save_id=7),
    "format_version is true": lambda o: o.update(format_version=True),
    "num_ranks is a string": lambda o: o.update(num_ranks="2"),
    "num_ranks is huge": lambda o: o.update(num_ranks=10**12),
    "structure is a list": lambda o: o.update(structure=[1]),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_json_types_in_metadata(ckpt, case):
    _edit(ckpt / "metadata.json", WRONG_TYPES[case])
    results = _all_fail_typed(ckpt)
    assert results["read_metadata"][0] == "MetadataError", results["read_metadata"]


RANK_MANIFEST_TYPES = {
    "files is a list": lambda o: o.update(files=[1]),
    "files missing": lambda o: o.pop("files"),
    "record holds a float block size": lambda o: o["files"]["rank_1.safetensors"].update(block_bytes=1.5),
    "rank is a list": lambda o: o.update(rank=[1]),
    "format_version is an object": lambda o: o.update(format_version={}),
}


@pytest.mark.parametrize("case", sorted(RANK_MANIFEST_TYPES))
def test_wrong_json_types_in_rank_manifest(ckpt, case):
    _edit(ckpt / "rank_1.json", RANK_MANIFEST_TYPES[case])
    results = _all_fail_typed(ckpt, expect_problem=False)
    assert results["validate"][2]
    assert results["load_distributed(1 of 2)"][0] is not None


HEADER_TYPES = {
    "dtype is a list": lambda h: h["model.w"].update(dtype=["F32"]),
    "shape is a string": lambda h: h["model.w"].update(shape="ab"),
    "shape holds a float": lambda h: h["model.w"].update(shape=[2.0, 3]),
    "data_offsets is an object": lambda h: h["model.w"].update(data_offsets={"a": 1}),
    "data_offsets has three ints": lambda h: h["model.w"].update(data_offsets=[0, 1, 2]),
    "entry is a number": lambda h: h.update({"model.w": 3}),
    "__metadata__ holds a number": lambda h: h.update(__metadata__={"format": 1}),
    "tensor missing from its file": lambda h: h.update({"model.v": h.pop("model.w")}),
}


@pytest.mark.parametrize("case", sorted(HEADER_TYPES))
def test_wrong_json_types_in_header(ckpt, case):
    header, data = read_safetensors(ckpt / "rank_1.safetensors")
    HEADER_TYPES[case](header)
    text = json.dumps(header).encode()
    write_safetensors_raw(ckpt / "rank_1.safetensors", text + b" " * (-len(text) % 8), data)
    refresh_record(ckpt, 1)
    results = _all_fail_typed(ckpt, expect_problem=False)
    assert results["load_distributed(1 of 2)"][0] in ("MetadataError", "TensorMismatchError")
    assert any("rank_1.safetensors" in p for p in results["validate"][2])


@pytest.mark.parametrize("name", ["metadata.json", "rank_1.json", "rank_0.safetensors"])
def test_directory_in_place_of_a_file(ckpt, name):
    os.remove(ckpt / name)
    os.mkdir(ckpt / name)
    results = _all_fail_typed(ckpt, expect_problem=False)
    assert "a directory, not a regular file" in "\n".join(results["validate"][2])


def test_broken_structure_never_validates_nor_drops_a_tensor(ckpt):
    # The structure no longer mentions model.b: before, validate said "complete and intact"
    # and loads silently returned the state without it.
    _edit(ckpt / "metadata.json", lambda o: o["structure"]["dict"][0][1]["dict"].pop())
    results = _all_fail_typed(ckpt)
    assert "structure does not match tensor_specs" in results["validate"][2][0]
    _edit(ckpt / "metadata.json", lambda o: o["structure"]["dict"][0][1]["dict"].append(["b", "O"]))
    assert "structure does not match" in results["validate"][2][0]
    assert not validate_distributed(ckpt).ok


def _split_model_key(o):
    """The "model" dict node written as two entries under one key, each holding part of its leaves."""
    top = o["structure"]["dict"]
    i = next(i for i, (key, _) in enumerate(top) if key == "model")
    children = top[i][1]["dict"]
    top[i:i + 1] = [["model", {"dict": children[:1]}], ["model", {"dict": children[1:]}]]


def test_a_structure_with_a_key_twice_is_refused_not_rebuilt_without_a_leaf(ckpt):
    # Leaf names stay unique (model.w, model.b), but rebuilt as one dict the second
    # "model" replaced the first: a load returned the state without model.w.
    _edit(ckpt / "metadata.json", _split_model_key)
    results = _all_fail_typed(ckpt)
    assert results["read_metadata"][0] == "MetadataError", results["read_metadata"]
    assert "the key 'model' twice" in results["validate"][2][0]


# --- hangs and memory bombs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["metadata.json", "rank_1.json", "rank_0.safetensors", "rank_1.safetensors"])
def test_fifo_in_place_of_a_file_never_blocks(ckpt, name):
    os.remove(ckpt / name)
    os.mkfifo(ckpt / name)
    results = _all_fail_typed(ckpt, timeout_s=30, expect_problem=False)
    errors = [r[0] for r in results.values() if r[0] is not None]
    assert errors and set(errors) <= {"MissingShardError", "IncompleteCheckpointError"}, results
    assert "a FIFO (named pipe), not a regular file" in "\n".join(results["validate"][2])


def test_seed_format_with_200k_ranks_plans_linearly(tmp_path):
    ranks = 200_000
    sizes = [4] + [0] * (ranks - 1)
    write_json(tmp_path / "metadata.json",
               {"num_ranks": ranks, "tensor_specs": {"w": {"full_shape": [4, 2], "shard_dim": 0, "shard_sizes": sizes}}})
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 2)}, str(tmp_path / "rank_0.safetensors"))

    def work():
        w = load_distributed(tmp_path, 0, ranks)["w"]
        problems = validate_distributed(tmp_path).problems
        try:
            reshard(tmp_path, ranks, 1, 0)
        except MissingShardError:
            pass
        return w.tolist(), problems

    outcome = guarded(work, timeout_s=120)  # quadratic planning took minutes; linear takes a second or two
    assert outcome.error is None, outcome.message
    w, problems = outcome.value
    assert w == [[1.0, 1.0]] * 4
    assert problems[0] == "rank_1.safetensors is missing (rank 1's data file)"
    assert problems[-1].startswith(f"{ranks - 1 - 5} more of the {ranks} data files are missing")


def test_claimed_shape_is_checked_against_the_files_before_planning(ckpt):
    # [2**50, 2] split on dim 1 planned ~2**31 read pieces and grew past 1.3 GB before any header was read.
    _edit(ckpt / "metadata.json",
          lambda o: o["tensor_specs"]["model.w"].update(full_shape=[2**50, 2], shard_dim=1, shard_sizes=[1, 1]))
    results = _all_fail_typed(ckpt, timeout_s=60)
    assert results["load_distributed(0 of 1)"][0] == "TensorMismatchError"
    assert "has shape [2, 3], the metadata gives this chunk [1125899906842624, 1]" in \
        results["load_distributed(0 of 1)"][2]


def test_huge_full_shape_never_reaches_torch_empty(ckpt):
    _edit(ckpt / "metadata.json", lambda o: o["tensor_specs"]["model.b"].update(full_shape=[2**40, 4]))
    outcome = guarded(lambda: load_consolidated(ckpt), timeout_s=60)
    assert outcome.error == "TensorMismatchError", outcome.message
    assert outcome.peak_growth_bytes < BUDGET_BYTES


def test_huge_block_bytes_is_refused_and_large_blocks_hash_in_bounded_chunks(ckpt):
    _edit(ckpt / "metadata.json", lambda o: o["files"]["rank_0.safetensors"].update(block_bytes=2**31))
    with pytest.raises(MetadataError, match="block_bytes is 2147483648, expected an integer in 1..1073741824"):
        load_distributed(ckpt, 0, 2)
    refresh_record(ckpt, 0, block_bytes=2**30)   # allowed, and correct: validate must not allocate 1 GiB
    outcome = guarded(lambda: (validate_distributed(ckpt).problems, load_distributed(ckpt, 0, 2, verify=True)["step"]))
    assert outcome.error is None, outcome.message
    assert outcome.value == ([], 3)
    assert outcome.peak_growth_bytes < BUDGET_BYTES


def add_empty_tensors(path, count: int) -> int:
    """Append ``count`` empty F32 tensors (``e0``, ``e1``...) to the header of safetensors file ``path``.

    They sit where the data ends, as a valid file may place them. Returns the header's size in bytes.
    """
    header, data = read_safetensors(path)
    end = max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")
    entry = ',"e%d":{"dtype":"F32","shape":[0],"data_offsets":[%d,%d]}'
    text = json.dumps(header, separators=(",", ":")).encode()[:-1]
    text += "".join(entry % (i, end, end) for i in range(count)).encode() + b"}"
    write_safetensors_raw(path, text + b" " * (-len(text) % 8), data)
    return len(text)


def test_header_of_many_empty_tensors_loads_in_linear_memory(ckpt):
    # The attack: 800k empty tensors (44 MB of header) took 23 s and 1 GB to load one key. Entries are
    # checked and packed as the parser meets them (one small tuple each), so memory stays a small
    # multiple of the header (it was 11x at 800k before; safetensors' own parser takes 13x).
    header_bytes = add_empty_tensors(ckpt / "rank_1.safetensors", 800_000)
    refresh_record(ckpt, 1)

    def load_then_validate():
        w = load_distributed(ckpt, 1, 2, keys=["model.w"])["model"]["w"].tolist()
        return w, validate_distributed(ckpt).problems

    outcome = guarded(load_then_validate, timeout_s=300)  # a hang guard, not a timing
    assert outcome.error is None, outcome.message
    assert outcome.value == ([[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]], [])
    assert outcome.peak_growth_bytes < 8 * header_bytes + BUDGET_BYTES, (outcome.peak_growth_bytes, header_bytes)

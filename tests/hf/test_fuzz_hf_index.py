"""Fuzzing shardkit.hf with damaged files: a typed shardkit error, or a correct load -- never a raw builtin.

Mutated index files (any JSON value swapped in anywhere), metrics files and
distributed ``metadata.json`` files, and truncated or byte-flipped
safetensors shards and ``.bin`` files. Each property also checks that
``checkpoint_problems`` never raises and ``validate_checkpoint`` returns a
bool. Every test runs under a hang guard (``pytest.mark.timeout``).
"""

import json
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import ShardkitError
from shardkit.hf import (
    checkpoint_problems,
    load_checkpoint,
    load_checkpoint_metrics,
    save_checkpoint,
    validate_checkpoint,
)

FUZZ = settings(max_examples=int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow],
                database=None)
HANG_GUARD = pytest.mark.timeout(240)

STATE = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16),
         "c": torch.arange(4, dtype=torch.int64)}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


class _Buffers(torch.nn.Module):
    """A module whose state dict has STATE's names, shapes and dtypes (module-mode loads)."""

    def __init__(self):
        super().__init__()
        for name, t in STATE.items():
            self.register_buffer(name, torch.zeros_like(t))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_base")
    for kind, safetensors in (("safe", True), ("bin", False)):
        save_checkpoint(str(root / kind), STATE, safetensors=safetensors, max_shard_size=30)
    save_checkpoint(str(root / "single"), STATE, safetensors=True, max_shard_size=2**30)
    from shardkit.checkpoint import save_distributed

    save_distributed({"w": torch.arange(8.0), "step": 3}, str(root / "dist"), 0, 1, None)
    return root


def _copy(base, kind) -> str:
    d = tempfile.mkdtemp(prefix="shardkit-fuzz-")
    shutil.copytree(base / kind, d, dirs_exist_ok=True)
    return d


def _typed_error_or_correct_load(d, expect=None):
    """Load ``d``; a ShardkitError is fine; a load must give the saved names with matching shapes/dtypes
    (and, when ``expect`` is given, equal values)."""
    try:
        loaded = load_checkpoint(d, None)
    except ShardkitError:
        loaded = None
    if loaded is not None:
        reference = expect if expect is not None else STATE
        for name, t in loaded.items():
            if name in reference:
                assert t.shape == reference[name].shape and t.dtype == reference[name].dtype, name
                if expect is not None:
                    assert torch.equal(t, expect[name]), name
    module = _Buffers()
    try:
        load_checkpoint(d, module, strict=False)
    except ShardkitError:
        pass
    problems = checkpoint_problems(d)
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    assert validate_checkpoint(d) in (True, False)
    return loaded


# --- mutated index files -------------------------------------------------------------------------------

def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _replace(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


@HANG_GUARD
@FUZZ
@given(kind=st.sampled_from(["safe", "bin"]), data=st.data(), value=json_values)
def test_mutated_index_gives_typed_error_or_correct_load(base, kind, data, value):
    d = _copy(base, kind)
    try:
        name = "model.safetensors.index.json" if kind == "safe" else "pytorch_model.bin.index.json"
        index = json.loads(open(os.path.join(d, name)).read())
        path = data.draw(st.sampled_from(list(_paths(index))), label="path")
        extra_key = data.draw(st.booleans(), label="add a key instead")
        if extra_key and isinstance(index["weight_map"], dict):
            index["weight_map"][data.draw(st.text(max_size=20), label="new name")] = value
        else:
            index = _replace(index, path, value)
        with open(os.path.join(d, name), "w") as f:
            f.write(json.dumps(index))
        _typed_error_or_correct_load(d)
    finally:
        shutil.rmtree(d)


@HANG_GUARD
@FUZZ
@given(kind=st.sampled_from(["safe", "bin"]), raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_index_of_random_bytes(base, kind, raw):
    d = _copy(base, kind)
    try:
        name = "model.safetensors.index.json" if kind == "safe" else "pytorch_model.bin.index.json"
        with open(os.path.join(d, name), "wb") as f:
            f.write(raw)
        _typed_error_or_correct_load(d)
    finally:
        shutil.rmtree(d)


# --- metrics --------------------------------------------------------------------------------------------

@HANG_GUARD
@FUZZ
@given(value=json_values, raw=st.none() | st.binary(max_size=100))
def test_metrics_of_any_json_or_bytes(base, value, raw):
    d = tempfile.mkdtemp(prefix="shardkit-fuzz-")
    try:
        with open(os.path.join(d, "eval_metrics.json"), "wb") as f:
            f.write(raw if raw is not None else json.dumps(value).encode())
        try:
            metrics = load_checkpoint_metrics(d)
        except ShardkitError:
            return
        assert isinstance(metrics, dict)
        assert all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                   for k, v in metrics.items())
    finally:
        shutil.rmtree(d)


# --- distributed checkpoint metadata, read through shardkit.hf ------------------------------------------------

@HANG_GUARD
@FUZZ
@given(data=st.data(), value=json_values)
def test_mutated_distributed_metadata(base, data, value):
    d = _copy(base, "dist")
    try:
        meta = json.loads(open(os.path.join(d, "metadata.json")).read())
        path = data.draw(st.sampled_from(list(_paths(meta))), label="path")
        with open(os.path.join(d, "metadata.json"), "w") as f:
            f.write(json.dumps(_replace(meta, path, value)))
        try:
            loaded = load_checkpoint(d, None)
        except ShardkitError:
            loaded = None
        if loaded is not None and "w" in loaded and loaded["w"].shape == (8,):
            assert torch.equal(loaded["w"], torch.arange(8.0))
        assert isinstance(checkpoint_problems(d), list)
    finally:
        shutil.rmtree(d)


# --- truncated and byte-flipped shards --------------------------------------------------------------------------

def _damaged_bytes(data, raw: bytes) -> bytes:
    how = data.draw(st.sampled_from(["truncate", "flip", "both"]), label="how")
    out = bytearray(raw)
    if how in ("flip", "both"):
        for _ in range(data.draw(st.integers(1, 6), label="flips")):
            pos = data.draw(st.integers(0, len(out) - 1), label="pos")
            out[pos] ^= data.draw(st.integers(1, 255), label="xor")
    if how in ("truncate", "both"):
        out = out[: data.draw(st.integers(0, len(out) - 1), label="keep")]
    return bytes(out)


@HANG_GUARD
@FUZZ
@given(kind=st.sampled_from(["safe", "bin", "single"]), data=st.data())
def test_truncated_or_flipped_shard(base, kind, data):
    d = _copy(base, kind)
    try:
        shards = sorted(n for n in os.listdir(d) if n.endswith((".safetensors", ".bin")))
        victim = os.path.join(d, data.draw(st.sampled_from(shards), label="shard"))
        with open(victim, "rb") as f:
            raw = f.read()
        with open(victim, "wb") as f:
            f.write(_damaged_bytes(data, raw))
        _typed_error_or_correct_load(d)
    finally:
        shutil.rmtree(d)


@HANG_GUARD
@FUZZ
@given(data=st.data())
def test_truncated_or_flipped_single_bin(base, data, tmp_path_factory):
    d = tempfile.mkdtemp(prefix="shardkit-fuzz-")
    try:
        path = os.path.join(d, "pytorch_model.bin")
        torch.save(STATE, path)
        with open(path, "rb") as f:
            raw = f.read()
        with open(path, "wb") as f:
            f.write(_damaged_bytes(data, raw))
        _typed_error_or_correct_load(d)
    finally:
        shutil.rmtree(d)


@HANG_GUARD
@FUZZ
@given(kind=st.sampled_from(["safe", "single"]), data=st.data(), value=json_values)
def test_mutated_safetensors_header(base, kind, data, value):
    import struct

    d = _copy(base, kind)
    try:
        shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
        victim = os.path.join(d, data.draw(st.sampled_from(shards), label="shard"))
        with open(victim, "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header = _replace(header, data.draw(st.sampled_from(list(_paths(header))), label="path"), value)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(victim, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        _typed_error_or_correct_load(d)
    finally:
        shutil.rmtree(d)

"""Hostile or damaged files under shardkit.hf: a typed shardkit error, never a raw builtin, a hang or a crash.

One test per class of attack found by fuzzing: wrong JSON types in an index,
metrics or checkpoint metadata; a tensor the index names but its shard lacks;
a damaged ``.bin``; a directory or FIFO where a file should be; JSON nested
too deep or with huge numbers; names and counts past the limits. And
``find_latest_checkpoint`` skipping a broken checkpoint with a logged reason.
"""

import json
import logging
import os
import struct
import threading
import zipfile

import pytest
import torch

from shardkit import knobs
from shardkit.errors import MetadataError, MissingShardError, ShardkitError, TensorMismatchError
from shardkit.hf import (
    checkpoint_problems,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    hf_to_distributed,
    load_checkpoint,
    load_checkpoint_metrics,
    load_shard_index,
    load_sharded_checkpoint,
    next_checkpoint_path,
    save_checkpoint,
    save_checkpoint_metrics,
    validate_checkpoint,
)

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
HANG_GUARD_S = 20


def _state():
    return {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3), "c": torch.zeros(4, dtype=torch.int64)}


def _sharded(path, safetensors=True):
    save_checkpoint(str(path), _state(), safetensors=safetensors, max_shard_size=30)
    return path


def _index_path(d, safetensors=True):
    return d / (SAFE_INDEX if safetensors else BIN_INDEX)


def _rewrite_index(d, mutate, safetensors=True):
    p = _index_path(d, safetensors)
    index = json.loads(p.read_text())
    mutate(index)
    p.write_text(json.dumps(index))


def _guarded(fn, *args, **kwargs):
    """Run ``fn`` in a thread; fail (not hang) if it blocks past the guard."""
    result = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed back to the test
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    if t.is_alive():
        _unblock_fifos()
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked for {HANG_GUARD_S}s (a FIFO was opened)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


_FIFOS: list = []


def _mkfifo(path):
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    _FIFOS.append(path)


def _unblock_fifos():
    for p in _FIFOS:  # a writer that opens and closes releases a blocked reader
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


# --- wrong JSON types in the index -------------------------------------------------------------

@pytest.mark.parametrize("mutate", [
    lambda ix: ix.update(weight_map=[["a", "x.safetensors"]]),
    lambda ix: ix.update(weight_map="model.safetensors"),
    lambda ix: ix.update(weight_map=None),
    lambda ix: ix.pop("weight_map"),
    lambda ix: ix.update(metadata=[1, 2]),
    lambda ix: ix.update(metadata="x"),
    lambda ix: ix["weight_map"].update(a=5),
    lambda ix: ix["weight_map"].update(a=None),
    lambda ix: ix["weight_map"].update(a=["model-00001-of-00003.safetensors"]),
    lambda ix: ix["weight_map"].update(a={"f": 1}),
    lambda ix: ix["metadata"].update(param_sharing="a,b"),
    lambda ix: ix["metadata"].update(param_sharing=[["a"]]),
    lambda ix: ix["metadata"].update(param_sharing=[["a", 3]]),
    lambda ix: ix["metadata"].update(param_sharing={"a": "b"}),
], ids=lambda f: "")
def test_wrong_json_types_in_index_raise_metadata_error(tmp_path, mutate):
    d = _sharded(tmp_path / "ck")
    _rewrite_index(d, mutate)
    for call in (lambda: load_checkpoint(str(d), None), lambda: load_shard_index(str(d), SAFE_INDEX)):
        with pytest.raises(MetadataError):
            call()
    assert not validate_checkpoint(str(d))
    assert checkpoint_problems(str(d))


def test_index_that_is_not_an_object_or_not_json(tmp_path):
    d = _sharded(tmp_path / "ck")
    for text in ["[1, 2]", "null", "7", '"x"', "{", "\xff\xfe", ""]:
        _index_path(d).write_bytes(text.encode("latin-1"))
        with pytest.raises(MetadataError):
            load_checkpoint(str(d), None)
        assert checkpoint_problems(str(d))


def test_user_index_of_wrong_shape_raises_metadata_error(tmp_path):
    d = _sharded(tmp_path / "ck")
    for bad in [None, [], {"weight_map": 3}, {"weight_map": {"a": 1}}, {1: 2}]:
        with pytest.raises(MetadataError):
            load_sharded_checkpoint(str(d), bad)


# --- JSON the parser itself chokes on -----------------------------------------------------------

@pytest.mark.parametrize("text", [
    '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}",     # RecursionError in json
    '{"weight_map": {}, "metadata": {"total_size": ' + "9" * 5000 + "}}",  # int past the digit limit
])
def test_json_too_deep_or_number_too_long_is_metadata_error(tmp_path, text):
    d = _sharded(tmp_path / "ck")
    _index_path(d).write_text(text)
    with pytest.raises(MetadataError):
        load_checkpoint(str(d), None)
    (d / "eval_metrics.json").write_text(text.replace("weight_map", "loss"))
    with pytest.raises(MetadataError):
        load_checkpoint_metrics(str(d))
    assert checkpoint_problems(str(d))


# --- metrics -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    '{"loss": "low"}', '{"loss": null}', '{"loss": [1]}', '{"loss": {"x": 1}}', '{"loss": true}',
    '{"loss": NaN}', '{"loss": ' + "1" * 400 + "}", "[1.0]", "3", "not json",
])
def test_malformed_metrics_raise_metadata_error(tmp_path, text):
    save_checkpoint_metrics(str(tmp_path), {"loss": 1.0})
    (tmp_path / "eval_metrics.json").write_text(text)
    with pytest.raises(MetadataError):
        load_checkpoint_metrics(str(tmp_path))


def test_good_metrics_still_load(tmp_path):
    save_checkpoint_metrics(str(tmp_path), {"loss": 1.5, "acc": 2})
    assert load_checkpoint_metrics(str(tmp_path)) == {"loss": 1.5, "acc": 2.0}


# --- limits on names and counts ------------------------------------------------------------------

def test_names_and_counts_past_the_limits_are_refused(tmp_path, monkeypatch):
    d = _sharded(tmp_path / "ck")
    _rewrite_index(d, lambda ix: ix["weight_map"].update({"n" * (knobs.MAX_NAME_CHARS + 1): "model-00001-of-00003.safetensors"}))
    with pytest.raises(MetadataError, match="MAX_NAME_CHARS"):
        load_shard_index(str(d), SAFE_INDEX)
    _sharded(d)
    monkeypatch.setattr(knobs, "MAX_INDEX_TENSORS", 2)
    with pytest.raises(MetadataError, match="over the limit of 2"):
        load_checkpoint(str(d), None)
    save_checkpoint_metrics(str(d), {"x": 1.0, "y": 2.0})
    monkeypatch.setattr(knobs, "MAX_METRICS", 1)
    with pytest.raises(MetadataError, match="over the limit of 1"):
        load_checkpoint_metrics(str(d))


# --- checkpoint metadata (a distributed checkpoint read through shardkit.hf) ----------------------

@pytest.mark.parametrize("mutate", [
    lambda m: m.update(tensor_specs=[1]),
    lambda m: m.update(num_ranks="two"),
    lambda m: m.update(num_ranks=-1),
    lambda m: m["tensor_specs"]["w"].update(full_shape="abc"),
    lambda m: m["tensor_specs"]["w"].update(dtype=["F32"]),
    lambda m: m.pop("tensor_specs"),
], ids=lambda f: "")
def test_wrong_types_in_distributed_metadata_are_typed(tmp_path, mutate):
    from shardkit.checkpoint import save_distributed

    d = tmp_path / "dist"
    save_distributed({"w": torch.arange(4.0)}, str(d), 0, 1, None)
    meta = json.loads((d / "metadata.json").read_text())
    mutate(meta)
    (d / "metadata.json").write_text(json.dumps(meta))
    assert get_checkpoint_metadata(str(d)).distributed
    with pytest.raises(ShardkitError):
        load_checkpoint(str(d), None)
    assert checkpoint_problems(str(d))


# --- a tensor the index names but its shard lacks -------------------------------------------------

@pytest.mark.parametrize("safetensors", [True, False])
def test_tensor_named_by_index_but_absent_from_shard(tmp_path, safetensors):
    d = _sharded(tmp_path / "ck", safetensors)
    shard = "model-00001-of-00003.safetensors" if safetensors else "pytorch_model-00001-of-00003.bin"
    _rewrite_index(d, lambda ix: ix["weight_map"].update(ghost=shard), safetensors)
    with pytest.raises((MetadataError, MissingShardError)):
        load_checkpoint(str(d), None)
    with pytest.raises((MetadataError, MissingShardError)):
        load_checkpoint(str(d), None, keys={"ghost"})
    with pytest.raises((MetadataError, MissingShardError)):
        hf_to_distributed(str(d), str(tmp_path / "out"))
    if safetensors:
        assert any("lacks" in p for p in checkpoint_problems(str(d)))


def test_param_sharing_that_cannot_be_tied_is_typed(tmp_path, tied_model):
    save_checkpoint(str(tmp_path), tied_model, safetensors=True)
    _rewrite_index(tmp_path, lambda ix: ix["metadata"].update(param_sharing=[["scale", "body.weight"]]))
    with pytest.raises(ShardkitError):
        load_checkpoint(str(tmp_path), type(tied_model)())


# --- damaged .bin ----------------------------------------------------------------------------------

def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip":
        for i in range(0, len(data), max(1, len(data) // 40)):
            data[i] ^= 0xFF
    elif how == "pickle-garbage":  # a valid zip whose data.pkl is garbage (NotImplementedError, etc.)
        src = zipfile.ZipFile(path)
        out = path.with_suffix(".tmp")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            for info in src.infolist():
                body = src.read(info)
                if info.filename.endswith("data.pkl"):
                    body = b"\x80\x02" + bytes(range(0x80, 0x100)) * 4
                z.writestr(info, body)
        src.close()
        data = out.read_bytes()
    elif how == "zip-bomb":
        out = path.with_suffix(".tmp")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", b"\x00" * (50 * 1024 * 1024))
        data = out.read_bytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "pickle-garbage", "zip-bomb"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_damaged_bin_is_metadata_error(tmp_path, how, layout):
    if layout == "single":
        target = tmp_path / "pytorch_model.bin"
        torch.save(_state(), str(target))
    else:
        _sharded(tmp_path, safetensors=False)
        target = tmp_path / "pytorch_model-00001-of-00003.bin"
    _damage(target, how)
    with pytest.raises(MetadataError):
        load_checkpoint(str(tmp_path), None)
    with pytest.raises(MetadataError):
        hf_to_distributed(str(tmp_path), str(tmp_path / "out"))
    checkpoint_problems(str(tmp_path))  # never raises


class _SparseStrided:
    def __reduce__(self):  # allowed by the weights-only unpickler, then NotImplementedError inside torch
        return (torch._utils._rebuild_sparse_tensor, (torch.strided, ()))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_bin_that_makes_torch_load_raise_not_implemented_is_typed(tmp_path, layout):
    name = "pytorch_model.bin" if layout == "single" else "pytorch_model-00001-of-00001.bin"
    torch.save({"w": _SparseStrided()}, str(tmp_path / name))
    if layout == "sharded":
        (tmp_path / BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"w": name}}))
    with pytest.raises(MetadataError, match="NotImplementedError"):
        load_checkpoint(str(tmp_path), None)


# --- a directory where a file should be -----------------------------------------------------------

@pytest.mark.parametrize("victim", [SAFE_INDEX, "model-00002-of-00003.safetensors", "model.safetensors",
                                    "eval_metrics.json"])
def test_directory_in_place_of_a_file_is_metadata_error(tmp_path, victim):
    if victim == "model.safetensors":
        (tmp_path / victim).mkdir()
    else:
        _sharded(tmp_path)
        save_checkpoint_metrics(str(tmp_path), {"loss": 1.0})
        (tmp_path / victim).unlink()
        (tmp_path / victim).mkdir()
    call = (lambda: load_checkpoint_metrics(str(tmp_path))) if victim.endswith("metrics.json") else \
        (lambda: load_checkpoint(str(tmp_path), None))
    with pytest.raises(MetadataError, match="a directory, not a regular file"):
        call()
    if not victim.endswith("metrics.json"):
        assert checkpoint_problems(str(tmp_path))


# --- a FIFO in place of any file, on every HF entry point -------------------------------------------

_ENTRY_POINTS = {
    "load_checkpoint": lambda d: load_checkpoint(str(d), None),
    "load_checkpoint_mmap": lambda d: load_checkpoint(str(d), None, mmap=True),
    "load_sharded_checkpoint": lambda d: load_sharded_checkpoint(
        str(d), json.loads(_index_path(d).read_text()) if _index_path(d).is_file() else
        {"weight_map": {"a": "model-00001-of-00003.safetensors"}}),
    "load_shard_index": lambda d: load_shard_index(str(d), SAFE_INDEX),
    "load_checkpoint_metrics": lambda d: load_checkpoint_metrics(str(d)),
    "hf_to_distributed": lambda d: hf_to_distributed(str(d), str(d) + "-dist"),
}
_SHARD1 = "model-00001-of-00003.safetensors"
_READS = {  # which of the victims each entry point opens
    "load_checkpoint": {SAFE_INDEX, _SHARD1},
    "load_checkpoint_mmap": {SAFE_INDEX, _SHARD1},
    "load_sharded_checkpoint": {_SHARD1},
    "load_shard_index": {SAFE_INDEX},
    "load_checkpoint_metrics": {"eval_metrics.json"},
    "hf_to_distributed": {SAFE_INDEX, _SHARD1},
}
_NEVER_RAISE = {
    "validate_checkpoint": lambda d: validate_checkpoint(str(d)),
    "checkpoint_problems": lambda d: checkpoint_problems(str(d)),
    "get_checkpoint_metadata": lambda d: get_checkpoint_metadata(str(d)),
}


@pytest.mark.parametrize("victim", [SAFE_INDEX, "model-00001-of-00003.safetensors", "eval_metrics.json"])
@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
def test_fifo_is_refused_by_every_entry_point(tmp_path, victim, entry):
    d = _sharded(tmp_path / "ck")
    save_checkpoint_metrics(str(d), {"loss": 1.0})
    _mkfifo(d / victim)
    if victim in _READS[entry]:
        with pytest.raises(MetadataError, match="FIFO"):
            _guarded(_ENTRY_POINTS[entry], d)
    else:
        _guarded(_ENTRY_POINTS[entry], d)  # does not touch the FIFO: works, and must not block


@pytest.mark.parametrize("victim", ["model.safetensors", "pytorch_model.bin", BIN_INDEX, "metadata.json"])
def test_fifo_single_file_bin_and_distributed(tmp_path, victim):
    d = tmp_path / "ck"
    d.mkdir()
    if victim == BIN_INDEX:
        _sharded(d, safetensors=False)
    elif victim == "metadata.json":
        from shardkit.checkpoint import save_distributed

        save_distributed({"w": torch.arange(4.0)}, str(d), 0, 1, None)
    _mkfifo(d / victim)
    with pytest.raises(MetadataError, match="FIFO"):
        _guarded(load_checkpoint, str(d), None)
    for name, fn in _NEVER_RAISE.items():
        _guarded(fn, d)
    assert any("FIFO" in p for p in _guarded(checkpoint_problems, str(d)))


@pytest.mark.parametrize("victim", [SAFE_INDEX, "model-00003-of-00003.safetensors"])
def test_fifo_never_raises_entry_points(tmp_path, victim):
    d = _sharded(tmp_path / "ck")
    _mkfifo(d / victim)
    assert _guarded(validate_checkpoint, str(d)) is False
    assert any("FIFO" in p for p in _guarded(checkpoint_problems, str(d)))
    assert _guarded(get_checkpoint_metadata, str(d)) is not None


def test_fifo_in_a_checkpoint_under_a_run_is_skipped(tmp_path, caplog):
    run = tmp_path / "run"
    _sharded(next_checkpoint_path(str(run), 1))
    newer = next_checkpoint_path(str(run), 2)
    _sharded(newer)
    _mkfifo(tmp_path / "run" / "checkpoints" / "checkpoint-2" / "model-00002-of-00003.safetensors")
    with caplog.at_level(logging.WARNING, logger="shardkit.hf.directory"):
        assert _guarded(find_latest_checkpoint, str(run)) == next_checkpoint_path(str(run), 1)
    assert "FIFO" in caplog.text


# --- find_latest_checkpoint skips a broken checkpoint and says why -------------------------------------

@pytest.mark.parametrize("breakage", ["bad-json-type", "truncated-header", "header-dtype-list", "missing-shard",
                                      "index-dir", "bin-garbage", "distributed-garbage"])
def test_find_latest_skips_broken_checkpoint_with_logged_reason(tmp_path, caplog, breakage):
    run = tmp_path / "run"
    good = next_checkpoint_path(str(run), 10)
    _sharded(good)
    bad = tmp_path / "run" / "checkpoints" / "checkpoint-20"
    _sharded(bad, safetensors=breakage != "bin-garbage")
    shard = bad / "model-00001-of-00003.safetensors"
    if breakage == "bad-json-type":
        _rewrite_index(bad, lambda ix: ix.update(weight_map=[1, 2]))
    elif breakage == "truncated-header":
        shard.write_bytes(shard.read_bytes()[:12])
    elif breakage == "header-dtype-list":
        header = json.dumps({"a": {"dtype": ["F32"], "shape": [6], "data_offsets": [0, 24]}}).encode()
        shard.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 24)
    elif breakage == "missing-shard":
        shard.unlink()
    elif breakage == "index-dir":
        _index_path(bad).unlink()
        _index_path(bad).mkdir()
    elif breakage == "bin-garbage":
        (bad / "pytorch_model-00001-of-00003.bin").write_bytes(b"PK\x03\x04" + os.urandom(200))
    elif breakage == "distributed-garbage":
        for p in bad.iterdir():
            p.unlink()
        (bad / "metadata.json").write_text('{"format": "shardkit.distributed", "format_version": 1, '
                                           '"num_ranks": [], "tensor_specs": 5}')
    with caplog.at_level(logging.WARNING, logger="shardkit.hf.directory"):
        assert find_latest_checkpoint(str(run)) == good
    assert "skipping" in caplog.text and "checkpoint-20" in caplog.text
    assert not validate_checkpoint(str(bad))
    assert checkpoint_problems(str(bad))


def test_header_with_unhashable_dtype_is_metadata_error(tmp_path):
    header = json.dumps({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(MetadataError):
        load_checkpoint(str(tmp_path), None)


def test_load_into_module_with_hostile_index_is_typed(tmp_path, tied_model):
    save_checkpoint(str(tmp_path), tied_model, safetensors=True)
    _rewrite_index(tmp_path, lambda ix: ix["weight_map"].update({"body.weight": 7}))
    with pytest.raises(MetadataError):
        load_checkpoint(str(tmp_path), type(tied_model)())
    with pytest.raises((TensorMismatchError, MetadataError, MissingShardError)):
        _rewrite_index(tmp_path, lambda ix: ix["weight_map"].update({"body.weight": "model.safetensors"}))
        load_checkpoint(str(tmp_path), type(tied_model)())

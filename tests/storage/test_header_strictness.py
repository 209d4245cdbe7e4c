"""A safetensors header is refused unless its tensors cover the data exactly and no key appears twice.

The safetensors package refuses such files ("invalid offset", "file not fully
covered"); shardkit used to load them, and ``validate_checkpoint`` called them
complete. Files written by shardkit and by ``safetensors.torch.save_file``
(every dtype, scalars, empty tensors) and a distributed checkpoint's rank
files still pass.
"""

import json
import struct

import pytest
import safetensors.torch as st
import torch

from shardkit.checkpoint import load_consolidated, save_distributed, validate_distributed
from shardkit.dtypes import NAME_TO_DTYPE
from shardkit.errors import MetadataError
from shardkit.hf import load_checkpoint, validate_checkpoint
from shardkit.storage import parse_json_object, read_header, storage_for, write_safetensors

_DATA = bytes(range(16))


def _raw_file(path, header: str, data: bytes) -> str:
    text = header.encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def _entry(name, dtype, shape, begin, end):
    return f'"{name}":{{"dtype":"{dtype}","shape":{json.dumps(shape)},"data_offsets":[{begin},{end}]}}'


def _read_header(path):
    store, p = storage_for(path)
    with store.open_reader(p) as reader:
        return read_header(reader)


#: (header JSON, data bytes, what the message must say). safetensors.load_file refuses them all but a repeated
#: key whose entries both fit the data: that one it takes silently, keeping the last.
MALFORMED = {
    "duplicate tensor key (the review's H1)": (
        "{" + _entry("a", "F32", [2], 0, 8) + "," + _entry("a", "F32", [2], 8, 16) + "}", _DATA, "'a' twice"),
    "duplicate tensor key, same range, other dtype": (
        "{" + _entry("a", "F32", [2], 0, 8) + "," + _entry("a", "I32", [2], 0, 8) + "}", _DATA[:8], "'a' twice"),
    "duplicate field inside an entry": (
        '{"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}}', _DATA[:8], "'dtype' twice"),
    "gap before the first tensor (H2)": (
        "{" + _entry("a", "F32", [2], 8, 16) + "}", _DATA, "tensor 'a' begins at data byte 8"),
    "gap between two tensors": (
        "{" + _entry("a", "F32", [1], 0, 4) + "," + _entry("b", "F32", [1], 8, 12) + "}", _DATA[:12],
        "tensor 'b' begins at data byte 8, but the tensor before it, 'a', ends at 4"),
    "first tensor at an unaligned offset (the review's H5 'unaligned')": (
        "{" + _entry("a", "F32", [1], 1, 5) + "}", _DATA[:5],
        "tensor 'a' begins at data byte 1, but the first tensor must begin at 0: 1 byte belongs to no tensor"),
    "one byte after the last tensor": (
        "{" + _entry("a", "F32", [2], 0, 8) + "}", _DATA[:9], "the last byte belongs to no tensor"),
    "bytes after the last tensor": (
        "{" + _entry("a", "F32", [2], 0, 8) + "}", _DATA[:12], "the last 4 bytes belong to no tensor"),
    "no tensors, but data": ("{}", _DATA[:8], "describes no tensors"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_read_header_refuses_what_safetensors_refuses(tmp_path, case):
    header, data, message = MALFORMED[case]
    path = _raw_file(tmp_path / "model.safetensors", header, data)
    if "same range" not in case:
        with pytest.raises(Exception, match="invalid offset|not fully covered|duplicate field"):
            st.load_file(path)
    with pytest.raises(MetadataError, match=message) as e:
        _read_header(path)
    assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize("case", MALFORMED)
def test_hf_load_and_validate_refuse_malformed_headers(tmp_path, case):
    header, data, message = MALFORMED[case]
    _raw_file(tmp_path / "model.safetensors", header, data)
    assert not validate_checkpoint(str(tmp_path))
    with pytest.raises(MetadataError, match=message):
        load_checkpoint(str(tmp_path), None)


def test_tiled_but_unaligned_tensor_loads_as_safetensors_reads_it(tmp_path):
    # safetensors 0.8 reads a tensor that starts at an odd offset (it copies); so does shardkit: same values.
    path = _raw_file(tmp_path / "model.safetensors",
                     "{" + _entry("b", "U8", [1], 0, 1) + "," + _entry("a", "F32", [2], 1, 9) + "}", _DATA[:9])
    expected = st.load_file(path)
    assert validate_checkpoint(str(tmp_path))
    for mmap in (True, False):
        got = load_checkpoint(str(tmp_path), None, mmap=mmap)
        assert all(torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)


def test_empty_tensors_at_the_end_and_a_header_of_no_tensors_pass(tmp_path):
    path = _raw_file(tmp_path / "a.safetensors",
                     "{" + _entry("a", "U8", [2], 0, 2) + "," + _entry("e", "F32", [0, 3], 2, 2) + "}", _DATA[:2])
    assert sorted(_read_header(path).tensors) == ["a", "e"]
    assert len(_read_header(_raw_file(tmp_path / "b.safetensors", "{}", b"")).tensors) == 0


def _every_dtype_state() -> dict:
    """A 3x5, a scalar and a 0x3 tensor of every dtype shardkit stores, from arbitrary bytes."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in NAME_TO_DTYPE.items():
        for label, shape in (("m", (3, 5)), ("s", ()), ("e", (0, 3))):
            numel = torch.Size(shape).numel()
            if dtype == torch.bool:
                out[f"{name}.{label}"] = torch.randint(0, 2, shape, generator=g).bool()
                continue
            raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
            out[f"{name}.{label}"] = raw.view(dtype).reshape(shape)
    return out


def _same_bits(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def test_shardkit_written_files_of_every_dtype_pass(tmp_path):
    sd = _every_dtype_state()
    store, path = storage_for(tmp_path / "model.safetensors")
    write_safetensors(store, path, list(sd.items()), {"format": "pt"})
    assert sorted(_read_header(path).tensors) == sorted(sd)
    assert validate_checkpoint(str(tmp_path))
    _same_bits(load_checkpoint(str(tmp_path), None), sd)


def test_safetensors_written_files_of_every_dtype_it_supports_pass(tmp_path):
    sd = {}
    for k, t in _every_dtype_state().items():
        try:
            st.save_file({k: t}, str(tmp_path / "probe.safetensors"))
            sd[k] = t
        except Exception:  # noqa: BLE001 -- a dtype this safetensors cannot store
            pass
    assert len(sd) >= 3 * 12  # bool, ints, floats, fp8 at least
    path = str(tmp_path / "model.safetensors")
    st.save_file(sd, path, metadata={"format": "pt"})
    (tmp_path / "probe.safetensors").unlink()
    assert sorted(_read_header(path).tensors) == sorted(sd)
    assert validate_checkpoint(str(tmp_path))
    _same_bits(load_checkpoint(str(tmp_path), None), sd)


def test_distributed_rank_files_still_parse(tmp_path):
    from shardkit.checkpoint import TensorShardSpec, ShardMetadata

    sd = {k: v for k, v in _every_dtype_state().items() if k.split(".")[0] in ("F32", "BF16", "I64", "BOOL", "U8",
                                                                               "F8_E4M3", "F64", "I16")}
    sd["rows"] = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    spec = ShardMetadata(2, {"rows": TensorShardSpec((10, 3), 0, (5, 5))})
    for rank in range(2):
        local = dict(sd, rows=sd["rows"][rank * 5:(rank + 1) * 5].clone())
        save_distributed(local, str(tmp_path), rank, 2, spec)
    report = validate_distributed(str(tmp_path))
    assert report.ok, report.problems
    for rank_file in sorted(tmp_path.glob("*.safetensors")):
        _read_header(str(rank_file))
    _same_bits(load_consolidated(str(tmp_path)), sd)


def test_parse_json_object_refuses_a_repeated_key_only_when_asked():
    text = b'{"a": {"x": 1, "x": 2}}'
    assert parse_json_object("t", text, fix="fix it") == {"a": {"x": 2}}  # json.loads' behaviour, kept by default
    with pytest.raises(MetadataError, match=r"t holds the key 'x' twice in one object.*; fix it"):
        parse_json_object("t", text, fix="fix it", unique_keys=True)
    hooked = parse_json_object("t", b'{"a": {"x": 1}}', fix="f", unique_keys=True,
                               object_hook=lambda d: {**d, "n": len(d)})
    assert hooked == {"a": {"x": 1, "n": 1}, "n": 1}  # the object hook still runs on every object

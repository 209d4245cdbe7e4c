"""Fuzzing of a distributed checkpoint's files: a typed shardkit error, or a correct load.

Hypothesis mutates a valid two-rank checkpoint: ``metadata.json``, a rank
manifest, or a safetensors header (its record refreshed so the parser, not the
checksum, meets the damage) get a random JSON value at a random path (huge,
negative, float, NaN/Infinity numbers, wrong types, nesting thousands deep), a
deleted key, a truncation or a flipped byte; data files get flipped bytes or a
truncation. Every reader then runs in a forked child (``hostile_helpers.guarded``)
with a hang guard, and its peak resident memory growth (VmHWM after a reset
through /proc/self/clear_refs) must stay within the files' size plus a fixed
budget. Each reader must raise a shardkit error or return the right values.
"""

import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hostile_helpers import (
    guarded,
    read_json,
    read_safetensors,
    refresh_record,
    run_readers,
    save_small,
    untyped,
    write_safetensors_raw,
)

BUDGET_BYTES = 64 << 20
SETTINGS = settings(max_examples=int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FULL_W = torch.arange(12.0).reshape(4, 3).tolist()

_numbers = st.sampled_from([0, 1, -1, 2, 3, 7, 2**31, 2**50, 2**63, 2**64, -2**63, 10**39, 10**60,
                            1.5, -0.0, 2.0, 1e300, float("inf"), float("-inf"), float("nan")])
_leaves = st.none() | st.booleans() | st.integers(-4, 8) | _numbers | st.text(max_size=6) | \
    st.sampled_from(["F32", "F64", "I64", "rank_0.safetensors", "../x.safetensors", "T", "O", "dict", "list"])
_values = st.recursive(_leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                       max_leaves=6)


class _Deep:
    """Stands for ``depth`` nested arrays; spliced in as text after json.dumps (which would recurse)."""

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"_Deep({self.depth})"


def _dumps(obj) -> bytes:
    deep: list[int] = []

    def default_walk(node):
        if isinstance(node, _Deep):
            deep.append(node.depth)
            return f"__deep_{len(deep) - 1}__"
        if isinstance(node, dict):
            return {k: default_walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [default_walk(v) for v in node]
        return node

    text = json.dumps(default_walk(obj))
    for i, depth in enumerate(deep):
        text = text.replace(f'"__deep_{i}__"', "[" * depth + "0" + "]" * depth)
    return text.encode()


_replacements = _values | st.integers(150, 5000).map(_Deep)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _paths(child, path + (key,))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _paths(child, path + (i,))


def _mutate_json(obj, data) -> bytes:
    """``obj`` with one random mutation, as JSON text (NaN/Infinity written as Python's json does)."""
    kind = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "truncate", "flip"]))
    paths = list(_paths(obj))
    if kind in ("replace", "delete"):
        path = data.draw(st.sampled_from(paths))
        if not path:
            return _dumps(data.draw(_replacements))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(_replacements)
        return _dumps(obj)
    text = json.dumps(obj).encode()
    at = data.draw(st.integers(0, len(text) - 1))
    if kind == "truncate":
        return text[:at]
    return text[:at] + bytes([text[at] ^ (1 << data.draw(st.integers(0, 7)))]) + text[at + 1:]


def _check(directory):
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if os.path.isfile(os.path.join(directory, n)))
    outcome = guarded(lambda: run_readers(directory), timeout_s=60)
    assert not outcome.hung, "a reader hung"
    assert outcome.error is None, outcome.message
    assert untyped(outcome.value) == {}, untyped(outcome.value)
    assert outcome.peak_growth_bytes <= size + BUDGET_BYTES, (outcome.peak_growth_bytes, size)
    return outcome.value


def _fresh(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    save_small(directory)
    return directory


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return _fresh(tmp_path_factory)


def _copy(pristine, tmp_path_factory):
    directory = tmp_path_factory.mktemp("case")
    for name in os.listdir(pristine):
        with open(os.path.join(pristine, name), "rb") as src, open(os.path.join(directory, name), "wb") as dst:
            dst.write(src.read())
    return directory


@SETTINGS
@given(data=st.data())
def test_fuzz_metadata_json(pristine, tmp_path_factory, data):
    directory = _copy(pristine, tmp_path_factory)
    obj = read_json(directory / "metadata.json")
    (directory / "metadata.json").write_bytes(_mutate_json(obj, data))
    results = _check(directory)
    _values_right_when_loaded(directory, results)


@SETTINGS
@given(data=st.data())
def test_fuzz_rank_manifest(pristine, tmp_path_factory, data):
    directory = _copy(pristine, tmp_path_factory)
    obj = read_json(directory / "rank_1.json")
    (directory / "rank_1.json").write_bytes(_mutate_json(obj, data))
    results = _check(directory)
    _values_right_when_loaded(directory, results)


@SETTINGS
@given(data=st.data(), rank=st.integers(0, 1))
def test_fuzz_safetensors_header(pristine, tmp_path_factory, data, rank):
    directory = _copy(pristine, tmp_path_factory)
    path = directory / f"rank_{rank}.safetensors"
    header, payload = read_safetensors(path)
    write_safetensors_raw(path, _mutate_json(header, data), payload)
    refresh_record(directory, rank)  # so the damage reaches the header parser, not just the checksum
    results = _check(directory)
    _values_right_when_loaded(directory, results)


@SETTINGS
@given(data=st.data(), name=st.sampled_from(["metadata.json", "rank_1.json", "rank_0.safetensors",
                                             "rank_1.safetensors"]))
def test_fuzz_bytes_of_any_file(pristine, tmp_path_factory, data, name):
    directory = _copy(pristine, tmp_path_factory)
    raw = (directory / name).read_bytes()
    at = data.draw(st.integers(0, len(raw) - 1))
    if data.draw(st.booleans()):
        raw = raw[:at]
    else:
        raw = raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1:]
    (directory / name).write_bytes(raw)
    _check(directory)


def _values_right_when_loaded(directory, results):
    """A load that succeeded must give the saved values (the data bytes were never touched)."""
    if results["load_consolidated"][0] is not None:
        return
    from shardkit.checkpoint import load_consolidated

    outcome = guarded(lambda: load_consolidated(directory, verify=True), timeout_s=60)
    if outcome.error is not None:
        assert outcome.typed, outcome.message
        return
    state = outcome.value
    w = state.get("model", {}).get("w") if isinstance(state.get("model"), dict) else state.get("model.w")
    if w is not None and tuple(w.shape) == (4, 3):
        assert w.tolist() == FULL_W


# --- the quick path of the header parser agrees with the reference one ------------------------------------------

_ITEMSIZES = {"F32": 4, "BF16": 2, "I64": 8, "BOOL": 1, "F8_E4M3": 1}
_bad_values = st.sampled_from([-1, 2**63 - 1, 2**63, 2**64, True, 2.0, "2", None, [2], {"a": 1}, "f32", "X", []])


@st.composite
def _headers(draw):
    """Up to 3 entries, valid but for an occasional bad value, extra key or overlap; and where their data ends."""
    entries, offset = {}, 0
    for name in draw(st.lists(st.sampled_from(["a", "b", "c", "dtype", "shape", "data_offsets"]), min_size=1,
                              max_size=3, unique=True)):
        dtype = draw(st.sampled_from(sorted(_ITEMSIZES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        begin = offset - draw(st.sampled_from([0] * 8 + [1, 4]))  # sometimes overlapping the one before
        end = begin + math.prod(shape) * _ITEMSIZES[dtype] + draw(st.sampled_from([0] * 8 + [1, -1]))
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 5)) == 0:  # one bad value somewhere in the entry
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "shape[]", "data_offsets[]", "extra"]))
            value = draw(_bad_values)
            if field.endswith("[]") and entry[field[:-2]]:
                entry[field[:-2]][draw(st.integers(0, len(entry[field[:-2]]) - 1))] = value
            else:
                entry[field.rstrip("[]")] = value
        entries[name] = entry
        offset = max(offset, end)
    return entries, offset


@settings(max_examples=300, deadline=None)
@given(header=_headers(), spare_bytes=st.sampled_from([-1, 0, 8]))
@example(header=({"a": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, 0), spare_bytes=0)
@example(header=({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, 4), spare_bytes=0)
@example(header=({"a": {"dtype": "F32", "shape": [1] * 64, "data_offsets": [0, 4]}}, 4), spare_bytes=0)
@example(header=({"a": {"dtype": "F32", "shape": [True, 2.0], "data_offsets": [0, 8]}}, 8), spare_bytes=0)
@example(header=({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, 8), spare_bytes=0)
@example(header=({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, 8), spare_bytes=0)
def test_header_quick_checks_agree_with_the_reference_checks(header, spare_bytes):
    """``parse_header`` (entries checked by an object_hook) accepts exactly what the per-entry reference accepts."""
    from shardkit.errors import MetadataError
    from shardkit.storage.safetensors_format.header import _entry, parse_header

    entries, data_bytes = header
    text = json.dumps(entries).encode()
    file_size = 8 + len(text) + max(0, data_bytes + spare_bytes)
    try:
        expected = {name: _entry("f", name, raw, 8 + len(text), file_size) for name, raw in entries.items()}
        spans = sorted((e.begin, e.end) for e in expected.values())
        if any(b < e for (_, e), (b, _) in zip(spans, spans[1:])):
            expected = None  # overlapping tensors
    except MetadataError:
        expected = None
    if expected is None:
        with pytest.raises(MetadataError):
            parse_header("f", text, file_size)
    else:
        header = parse_header("f", text, file_size)
        assert dict(header.tensors) == expected
        assert header.data_end == max((e.end for e in expected.values()), default=header.data_start)

"""The shard index: plan which tensor goes to which file, and read/write the index JSON.

An index is ``{"metadata": {"total_size": N, ...}, "weight_map": {name: file}}``,
the layout ``transformers`` writes. Tied parameters are
recorded as ``metadata["param_sharing"]``: groups of names whose first name is
the one stored. Planning here is pure (names and byte counts in, names out);
reading an index checks every file name before anything else is opened.
This module does not write tensor files.

Example::

    index = make_shard_index([model.state_dict()], safetensors=True, max_shard_size=2**30)
    save_shard_index(index, "out", index_file_name(True))
    assert load_shard_index("out", index_file_name(True)) == index
"""

from __future__ import annotations

import json
import warnings
from typing import Dict, List, Optional, Sequence, Union

from torch import Tensor
from torch.nn import Module

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.hf.saving.save_checks import json_problem
from shardkit.hf.sharing import alias_to_source, find_shared_groups
from shardkit.hf.untrusted import check_limits, read_json_file
from shardkit.sizes import size_bytes
from shardkit.storage import check_relative_name, storage_for

__all__ = [
    "StateDictLike",
    "ShardIndex",
    "SharingMetadataT",
    "SAFE_INDEX_NAME",
    "BIN_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "BIN_WEIGHTS_NAME",
    "index_file_name",
    "shard_file_name",
    "plan_shards",
    "shard_size_bytes",
    "make_shard_index",
    "save_shard_index",
    "index_json",
    "write_index_json",
    "load_shard_index",
    "check_index",
    "sharing_of",
    "sharing_for",
]

StateDictLike = Union[Module, Dict[str, Tensor]]
ShardIndex = Dict[str, Dict[str, str]]
SharingMetadataT = List[List[str]]

SAFE_INDEX_NAME = "model.safetensors.index.json"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
BIN_WEIGHTS_NAME = "pytorch_model.bin"


def index_file_name(safetensors: bool) -> str:
    """``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``."""
    return SAFE_INDEX_NAME if safetensors else BIN_INDEX_NAME


def shard_file_name(number: int, count: int, safetensors: bool) -> str:
    """The Hugging Face name of shard ``number`` (1-based) of ``count``."""
    stem, ext = ("model", "safetensors") if safetensors else ("pytorch_model", "bin")
    return f"{stem}-{number:05d}-of-{count:05d}.{ext}"


def suffix_for(safetensors: bool) -> tuple[str, ...]:
    return (".safetensors",) if safetensors else (".bin",)


def plan_shards(name_bytes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Cut ``(name, nbytes)`` pairs, in order, into shards of at most ``max_shard_bytes``.

    A shard goes over the limit only when it holds a single tensor that alone
    does. Pure: no tensors, no files.

    >>> plan_shards([("a", 6), ("b", 6), ("c", 20), ("d", 1)], 10)
    [['a'], ['b'], ['c'], ['d']]
    """
    if max_shard_bytes <= 0:
        raise MetadataError(
            f"max_shard_size must be a positive number of bytes, got {max_shard_bytes!r}; "
            f"e.g. 2**31 for 2 GiB shards"
        )
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in name_bytes:
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards


def shard_size_bytes(max_shard_size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int as is, or a string as ``transformers`` reads it
    (:func:`shardkit.sizes.size_bytes`: ``"5GB"`` is 10**9 bytes times 5, ``"2GiB"`` 2**31).

    >>> shard_size_bytes("5GB"), shard_size_bytes("2GiB"), shard_size_bytes(1000), shard_size_bytes("1000")
    (5000000000, 2147483648, 1000, 1000)
    """
    return size_bytes(max_shard_size, what="max_shard_size")


def sharing_of(index: ShardIndex) -> SharingMetadataT:
    """The ``param_sharing`` groups recorded in ``index`` (``[]`` when none)."""
    return list(index.get("metadata", {}).get("param_sharing", []) or [])


def make_shard_index(
    state_dictionaries: List[Dict[str, Tensor]],
    metadata: Optional[Dict] = None,
    safetensors: bool = False,
    max_shard_size: Union[int, str] = 2**32,
    param_sharing_metadata: Optional[List[List[str]]] = None,
) -> ShardIndex:
    """Build the index for one or more state dicts; each gets its own shard files.

    Names tied to an earlier name (``param_sharing_metadata``, or detected
    from tensors that alias the same memory when it is ``None``) are left out
    of the weight map and recorded as ``metadata["param_sharing"]``. Names of
    ``param_sharing_metadata`` that no state dict holds are left out of the
    groups with a ``UserWarning`` (forgather accepts them too; they cannot be
    tied to anything stored). ``max_shard_size``: bytes, or a string such as
    ``"5GB"`` (see :func:`shard_size_bytes`). Writes nothing.

    Example::

        index = make_shard_index([sd_rank0, sd_rank1], safetensors=True)
    """
    if metadata is not None and not isinstance(metadata, dict):
        raise MetadataError(f"metadata must be a dict (or None), got {type(metadata).__name__}: {str(metadata)[:80]}")
    max_shard_bytes = shard_size_bytes(max_shard_size)
    sharing = sharing_for(state_dictionaries, param_sharing_metadata)
    skip = set(alias_to_source(sharing))
    plans = [
        plan_shards([(n, _nbytes(t)) for n, t in sd.items() if n not in skip], max_shard_bytes)
        for sd in state_dictionaries
    ]
    count = sum(len(p) for p in plans)
    weight_map: dict[str, str] = {}
    number = 0
    for plan in plans:
        for names in plan:
            number += 1
            weight_map.update(dict.fromkeys(names, shard_file_name(number, count, safetensors)))
    sizes = {n: _nbytes(t) for sd in state_dictionaries for n, t in sd.items()}
    meta = {"total_size": sum(sizes[n] for n in weight_map), **(metadata or {})}
    if sharing:
        meta["param_sharing"] = sharing
    return {"metadata": meta, "weight_map": weight_map}


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def sharing_for(state_dictionaries, explicit: Optional[SharingMetadataT]) -> SharingMetadataT:
    """The tie groups an index records: ``explicit`` cut to the names present (with a ``UserWarning`` for
    absent ones), or, when None, the groups of tensors over the same memory (DTensors: their local parts)."""
    if explicit is not None:
        return _present_sharing(explicit, {n for sd in state_dictionaries for n in sd})
    groups: SharingMetadataT = []
    for sd in state_dictionaries:
        groups.extend(find_shared_groups(list(sd.items())))
    return groups


def _present_sharing(explicit: SharingMetadataT, present: set) -> SharingMetadataT:
    """Each group cut to the names ``present`` holds (groups left with one name dropped), with a warning.

    Warn, not raise: forgather stores such groups as given and skips absent
    names when it reties, and pipeline code passes the whole model's groups
    for one stage's state. Silently dropping them hid typos; keeping an
    absent first name would have dropped its aliases' tensors from the index.
    """
    groups, absent = [], []
    for group in explicit:
        kept = [n for n in group if n in present]
        absent += [n for n in group if n not in present]
        if len(kept) > 1:
            groups.append(kept)
    if absent:
        warnings.warn(
            f"param_sharing_metadata names {absent[:10]} ({len(absent)} in all), which are not in the state "
            f"dicts being indexed; ties are recorded among the names that are (groups left with one name are "
            f"dropped). Check the names, or build the groups with create_sharing_metadata(module).",
            UserWarning,
            stacklevel=3,
        )
    return groups


def save_shard_index(shard_index: ShardIndex, output_dir: str, index_name: str, *, sync_files: bool = True) -> None:
    """Write ``shard_index`` as ``output_dir/index_name``, atomically (fsync'd unless ``sync_files=False``).

    Write the index only after every shard it names is complete: its
    appearance is what makes the checkpoint count. An index the loaders
    would refuse raises ``MetadataError`` (see :func:`index_json`) and
    writes nothing.
    """
    write_index_json(index_json(shard_index, index_name), output_dir, index_name, sync_files=sync_files)


def index_json(shard_index: ShardIndex, index_name: str) -> bytes:
    """The bytes :func:`save_shard_index` writes; ``MetadataError`` for an index the loaders would refuse.

    Refused, naming the metadata key: values strict JSON cannot hold (a numpy
    scalar, a tensor, NaN, an infinity; see ``save_checks.json_problem``),
    a malformed index (:func:`check_index`), and an index over
    ``knobs.MAX_INDEX_BYTES``. Call it before touching a directory, so a
    refused index leaves the previous checkpoint whole. Writes nothing.
    """
    check_index(shard_index, index_name)
    problem = json_problem(shard_index.get("metadata", {}), "metadata", depth=2)
    if problem:
        raise MetadataError(f"the {index_name} to be written cannot be read back: {problem}. Nothing was written.")
    data = json.dumps(shard_index, indent=2, sort_keys=False, allow_nan=False).encode("utf-8")
    if len(data) > knobs.MAX_INDEX_BYTES:
        raise MetadataError(
            f"the {index_name} to be written is {len(data):,} bytes; the loaders read at most "
            f"{knobs.MAX_INDEX_BYTES:,} (knobs.MAX_INDEX_BYTES). Keep large values out of the metadata. "
            f"Nothing was written."
        )
    return data


def write_index_json(data: bytes, output_dir: str, index_name: str, *, sync_files: bool = True) -> None:
    """Publish index bytes from :func:`index_json` as ``output_dir/index_name``, atomically."""
    store, root = storage_for(output_dir)
    store.makedirs(root)
    with store.atomic_writer(store.join(root, index_name), sync_files) as f:
        f.write(data)


def load_shard_index(output_dir: str, index_name: str) -> ShardIndex:
    """Read and check ``output_dir/index_name``.

    Refuses (``MetadataError``) an index over ``knobs.MAX_INDEX_BYTES``, one
    that is not JSON of the expected shape, and any file name that is
    absolute, has a ``..`` part or the wrong extension -- before any shard is
    opened. A path that is not a regular file (a FIFO, a directory) is
    refused without opening it. Does not open the shards.
    """
    check_relative_name(index_name, (".index.json",), source="index file name")
    store, root = storage_for(output_dir)
    path = store.join(root, index_name)
    index = read_json_file(store, path, fix='a shard index is {"metadata": {...}, "weight_map": {name: file}}; '
                                            "re-save the checkpoint")
    check_index(index, index_name, source=path)
    return index


def check_index(index: object, index_name: str, *, source: str = "index", suffixes: tuple = ()) -> None:
    """Raise ``MetadataError`` unless ``index`` has the shape of a shard index with safe file names."""
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        found = type(index.get("weight_map")).__name__ if isinstance(index, dict) else type(index).__name__
        raise MetadataError(
            f"{source}: expected an object with a 'weight_map' object (name -> file), found {found} "
            f"(keys {[str(k)[:40] for k in list(index)[:5]] if isinstance(index, dict) else '-'}); "
            f"the index is corrupt or not a shard index"
        )
    meta = index.get("metadata", {})
    if not isinstance(meta, dict):
        raise MetadataError(f"{source}: 'metadata' must be an object, found {type(meta).__name__}")
    suffixes = suffixes or suffix_for(".safetensors" in index_name)
    weight_map = index["weight_map"]
    check_limits(source, "weight_map entries", weight_map, max_count=knobs.MAX_INDEX_TENSORS)
    checked: set = set()  # a few files hold thousands of names: check each file name once
    for name, file_name in weight_map.items():
        if not isinstance(name, str):
            raise MetadataError(f"{source}: weight_map key {name!r} is not a string")
        if not (isinstance(file_name, str) and file_name in checked):
            check_relative_name(file_name, suffixes, source=source)
            checked.add(file_name)
    check_limits(source, "shard files", checked, max_count=knobs.MAX_INDEX_TENSORS)
    _check_sharing(meta.get("param_sharing", []), source)


def _check_sharing(groups: object, source: str) -> None:
    ok = isinstance(groups, list) and all(
        isinstance(g, list) and len(g) >= 2 and all(isinstance(n, str) for n in g) for g in groups
    )
    if not ok:
        raise MetadataError(
            f"{source}: metadata.param_sharing must be a list of groups of two or more names, "
            f"found {str(groups)[:200]}"
        )
    names = [n for g in groups for n in g]
    check_limits(source, "param_sharing names", names, max_count=knobs.MAX_INDEX_TENSORS)
    seen: set[str] = set()
    for name in names:  # a name in two groups has two sources: the loads would disagree on it
        if name in seen:
            raise MetadataError(f"{source}: metadata.param_sharing names {name!r} twice; each name belongs to "
                                f"at most one group of tied names. The index is corrupt: re-save the checkpoint")
        seen.add(name)


def files_to_names(weight_map: Dict[str, str], names) -> dict[str, list[str]]:
    """Group ``names`` by the file that holds them, files in first-seen order."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(weight_map[name], []).append(name)
    return out

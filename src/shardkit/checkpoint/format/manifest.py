"""``metadata.json`` and the per-rank manifests: write, read, check the version.

Files of a checkpoint directory (``docs/format.md``):

- ``rank_<r>.safetensors``: rank r's data file;
- ``rank_<r>.json``: rank r's manifest, written atomically after its data
  file, holding that file's :class:`~shardkit.storage.FileRecord`;
- ``metadata.json``: the global description, written last by rank 0.

**Completeness rule**: a checkpoint is complete when ``metadata.json``
exists and, for every rank r, the record of ``rank_<r>.safetensors`` is
known (from ``metadata.json``'s ``files`` or from ``rank_<r>.json``) and the
file exists with that size. With a process group rank 0 gathers every record
into ``metadata.json``; without one, it can only record its own, and the
other ranks' manifests complete the picture. A seed-format (ferrotorch 0.4)
directory has no records at all: its completeness is checked against the
safetensors headers instead. This module reads and writes JSON only.

Example::

    manifest = read_manifest(storage, "/ckpt/step-100")
    records = file_records(storage, "/ckpt/step-100", manifest)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from shardkit import knobs
from shardkit.checkpoint.format.chunks import Chunk, parse_chunks
from shardkit.checkpoint.format.compact_manifest import GridChunks, check_grid_cells, layout_json, parse_grid
from shardkit.checkpoint.format.nested import check_structure
from shardkit.checkpoint.format.rank_state import is_rank_state_name
from shardkit.checkpoint.format.references import Base, base_file_key, parse_bases, split_key
from shardkit.checkpoint.format.spec import TensorShardSpec, check_spec
from shardkit.dtypes import NAME_TO_DTYPE, itemsize_bytes
from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError, TensorMismatchError
from shardkit.storage import FileRecord, Storage, check_relative_name, parse_json_object
from shardkit.storage.json_io import expect_dict, expect_int, expect_list, expect_str, short_repr
from shardkit.storage.plain_values import decode_value, encode_objects

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUPPORTED_VERSIONS",
    "METADATA_FILE",
    "SavedTensor",
    "Manifest",
    "data_file_name",
    "rank_manifest_name",
    "manifest_to_json",
    "parse_manifest",
    "read_manifest",
    "rank_manifest_json",
    "file_records",
    "write_json",
]

FORMAT = "shardkit.distributed"
RANK_FORMAT = "shardkit.distributed.rank"
FORMAT_VERSION = 1
CHUNKED_VERSION = 2          # every tensor described by its chunks (checkpoint/chunks.py, docs/format.md)
COMPACT_VERSION = 3          # what writers write: a grid entry for a regular layout, else chunks, which may name
                             # a base checkpoint's file (compact_manifest.py; references.py, incremental saves)
SUPPORTED_VERSIONS = (1, 2, 3)
METADATA_FILE = "metadata.json"


def data_file_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def rank_manifest_name(rank: int) -> str:
    return f"rank_{rank}.json"


@dataclass(frozen=True)
class SavedTensor:
    """A saved tensor: its layout, dtype name (None in seed format: read the header) and owner.

    Version 2 and 3 tensors carry ``chunks`` (their spec is then the full shape, replicated): a
    tuple of :class:`Chunk` (the general list) or a :class:`GridChunks` (version 3's compact grid
    entry; the same sequence interface, plus ``overlapping(box)`` without expanding it); older
    ones are upgraded to chunks by ``plan.saved_chunks``. ``split_dim`` (version 2, optional):
    the dimension a ``shard_spec`` save split the tensor along (``plan.split_spec``).
    """

    spec: TensorShardSpec
    dtype: str | None
    owner_rank: int | None = None
    chunks: tuple[Chunk, ...] | GridChunks | None = None
    split_dim: int | None = None
    #: the sizes along ``split_dim`` of a tensor with no element (version 3, optional: no chunk records them)
    split_sizes: tuple[int, ...] | None = None


@dataclass
class Manifest:
    """The parsed ``metadata.json``; ``format_version`` is None for a seed-format directory.

    ``objects`` holds the plain values themselves (``float("inf")``, ``b"..."``,
    ``np.float32(1.5)``); :func:`manifest_to_json` encodes them for the file
    and :func:`parse_manifest` decodes them (``storage.plain_values``).
    """

    format_version: int | None
    num_ranks: int
    tensors: dict[str, SavedTensor]
    files: dict[str, FileRecord] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    structure: Any = None
    user_metadata: dict = field(default_factory=dict)
    save_id: str | None = None   # ties rank manifests to this metadata.json (saves without a group)
    bases: list[Base] = field(default_factory=list)  # version 3: the siblings whose files chunks reference

    def base_dirs(self) -> set[str]:
        """The sibling directories this checkpoint reads chunks from (empty for a self-contained one)."""
        return {b.dir for b in self.bases}


def manifest_to_json(m: Manifest) -> dict:
    if any(t.chunks is not None for t in m.tensors.values()):
        return _chunked_to_json(m)
    specs = {}
    for name, t in m.tensors.items():
        entry = {"full_shape": list(t.spec.full_shape), "shard_dim": t.spec.shard_dim,
                 "shard_sizes": list(t.spec.shard_sizes), "dtype": t.dtype}
        if t.owner_rank is not None:
            entry["owner_rank"] = t.owner_rank
        specs[name] = entry
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "num_ranks": m.num_ranks,
        "tensor_specs": specs, "files": {f: r.to_json() for f, r in sorted(m.files.items())},
        "objects": encode_objects(m.objects), "structure": m.structure, "user_metadata": m.user_metadata,
        **({"save_id": m.save_id} if m.save_id else {}),
    }


def _chunked_to_json(m: Manifest) -> dict:
    index = {b.dir: i for i, b in enumerate(m.bases)}
    specs = {name: {"full_shape": list(t.spec.full_shape), "dtype": t.dtype, **layout_json(t.chunks, index),
                    **({"shard_dim": t.split_dim} if t.split_dim is not None else {}),
                    **({"shard_sizes": list(t.split_sizes)} if t.split_sizes is not None else {})}
             for name, t in m.tensors.items()}
    own = {f: r.to_json() for f, r in sorted(m.files.items()) if "/" not in f}
    out = {
        "format": FORMAT, "format_version": COMPACT_VERSION,
        "num_ranks": m.num_ranks, "tensor_specs": specs, "files": own,
        "objects": encode_objects(m.objects), "structure": m.structure, "user_metadata": m.user_metadata,
    }
    if m.bases:
        out["bases"] = [{"dir": b.dir, "save_id": b.save_id,
                         "files": {split_key(f)[1]: r.to_json() for f, r in sorted(m.files.items())
                                   if split_key(f)[0] == b.dir}}
                        for b in m.bases]
    return out


def write_json(storage: Storage, path: str, obj: Any) -> None:
    """Publish ``obj`` as JSON at ``path`` atomically (invariant 1).

    Refuses (:class:`TensorMismatchError`, nothing written) a file larger than
    the readers accept (``knobs.MAX_INDEX_BYTES``): it would be a checkpoint
    that no load can open.
    """
    # One line, default separators: the C encoder (indent= falls back to the pure-Python one, ~5x slower).
    data = json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    if len(data) > knobs.MAX_INDEX_BYTES:
        _too_large(path, len(data), obj)
    with storage.atomic_writer(path) as f:
        f.write(data)


def _too_large(path: str, size: int, obj: Any) -> None:
    objects = obj.get("objects") if isinstance(obj, dict) else None
    share = len(json.dumps(objects, ensure_ascii=False)) if objects else 0
    raise TensorMismatchError(
        f"{path} would be {size:,} bytes, more than readers accept ({knobs.MAX_INDEX_BYTES:,}, "
        f"knobs.MAX_INDEX_BYTES); its plain values take {share:,} of them. Store large values as tensors (bytes "
        f"as a uint8 tensor: torch.frombuffer(bytearray(b), dtype=torch.uint8)); per-rank ones (rank_state=) are "
        f"stored once per rank. Nothing was committed")


def read_manifest(storage: Storage, directory: str, *, parse=None) -> Manifest:
    """Read and check ``<directory>/metadata.json`` (``parse``: :func:`parse_manifest`, or one that
    gives the same result, as ``format.manifest_cache.ManifestCache`` does).

    A missing directory raises :class:`MissingShardError`; a directory
    without ``metadata.json`` raises :class:`IncompleteCheckpointError`;
    anything malformed or of an unknown version raises :class:`MetadataError`.
    """
    if not storage.exists(directory):
        raise MissingShardError(f"checkpoint directory {directory} does not exist")
    path = storage.join(directory, METADATA_FILE)
    if not storage.exists(path):
        raise IncompleteCheckpointError(
            f"{directory} has no {METADATA_FILE}: the save never finished (or this is not a "
            f"shardkit checkpoint). Load an earlier checkpoint."
        )
    return (parse or parse_manifest)(path, storage.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES))


def parse_manifest(source: str, data: bytes) -> Manifest:
    """Parse the bytes of a ``metadata.json`` (``source`` names it in errors).

    Every field is type-checked here, once (limits in ``shardkit.knobs``), so
    later code trusts the result: ``num_ranks`` in ``1..MAX_NUM_RANKS``, each
    spec's shape, dim and sizes ints within bounds and consistent, dtypes
    known, file names safe with well-formed records, ``objects`` plain values
    and ``structure`` a tree whose leaves are exactly the tensors and objects.
    Anything else raises :class:`MetadataError`.
    """
    obj = _load_json(source, data)
    version = _check_version(source, obj, FORMAT)
    num_ranks = expect_int(obj.get("num_ranks"), f"{source}: num_ranks", low=1, high=knobs.MAX_NUM_RANKS)
    raw_specs = expect_dict(obj.get("tensor_specs"), f"{source}: tensor_specs")
    files = {check_relative_name(f, (".safetensors",), source=source): FileRecord.from_json(f, r)
             for f, r in expect_dict(obj.get("files") or {}, f"{source}: files").items()}
    if any("/" in f for f in files):
        raise MetadataError(f"{source}: files names {sorted(f for f in files if '/' in f)[:3]}; a checkpoint's own "
                            f"data files are plain names (a base's files are listed under bases)")
    if obj.get("bases") is not None and version != COMPACT_VERSION:
        raise MetadataError(f"{source} has bases but format_version {version}; references need version "
                            f"{COMPACT_VERSION}. {_FIX}")
    bases = parse_bases(source, obj.get("bases"), files, _FIX)
    tensors = {expect_str(name, f"{source}: a tensor name"):
               _saved_tensor(source, name, raw, num_ranks, version, bases, files)
               for name, raw in raw_specs.items()}
    check_grid_cells(source, (t.chunks for t in tensors.values()), _FIX)
    objects = {name: decode_value(raw, f"{source}: object {short_repr(name)}")
               for name, raw in expect_dict(obj.get("objects") or {}, f"{source}: objects").items()}
    user_metadata = expect_dict(obj.get("user_metadata") or {}, f"{source}: user_metadata")
    structure = obj.get("structure")
    if structure is not None:
        # Per-rank state (rank_state=) is stored beside the user's state, outside its structure.
        check_structure(structure, {n: t for n, t in tensors.items() if not is_rank_state_name(n)},
                        {n: v for n, v in objects.items() if not is_rank_state_name(n)}, source=source)
    save_id = obj.get("save_id")
    if save_id is not None:
        expect_str(save_id, f"{source}: save_id")
    return Manifest(version, num_ranks, tensors, files, objects, structure, user_metadata, save_id, bases)


_FIX = "The file is corrupt or not a shardkit checkpoint: load an earlier checkpoint."


def _load_json(source: str, data: bytes) -> Any:
    return parse_json_object(source, data, fix="the file is corrupt or was cut short")


def _check_version(source: str, obj: dict, expected_format: str) -> int | None:
    if "format" not in obj and "format_version" not in obj:
        return None  # the seed's format: num_ranks + tensor_specs only
    if obj.get("format") != expected_format:
        raise MetadataError(f"{source} has format {short_repr(obj.get('format'))}, expected {expected_format!r}")
    version = obj.get("format_version")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise MetadataError(
            f"{source} has format_version {short_repr(version)}; this shardkit supports "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}. Upgrade shardkit to read it."
        )
    return version


def _saved_tensor(source: str, name: str, raw: Any, num_ranks: int, version: int | None, bases: list[Base],
                  files: dict[str, FileRecord]) -> SavedTensor:
    what = f"{source}: tensor {short_repr(name)}"
    raw = expect_dict(raw, what)
    if version in (CHUNKED_VERSION, COMPACT_VERSION):
        return _chunked_tensor(source, name, raw, num_ranks, version, bases, files)
    shape = expect_list(raw.get("full_shape"), f"{what}: full_shape", max_items=knobs.MAX_TENSOR_NDIM)
    full_shape = tuple(expect_int(d, f"{what}: full_shape[{i}]") for i, d in enumerate(shape))
    shard_dim = raw.get("shard_dim")
    if shard_dim is not None:
        shard_dim = expect_int(shard_dim, f"{what}: shard_dim", high=knobs.MAX_TENSOR_NDIM)
    sizes = expect_list(raw.get("shard_sizes") or [], f"{what}: shard_sizes", max_items=num_ranks)
    shard_sizes = tuple(expect_int(s, f"{what}: shard_sizes[{i}]") for i, s in enumerate(sizes))
    spec = TensorShardSpec(full_shape, shard_dim, shard_sizes)
    check_spec(name, spec, num_ranks, source=source)
    dtype = raw.get("dtype")
    if (version is not None or dtype is not None) and (not isinstance(dtype, str) or dtype not in NAME_TO_DTYPE):
        raise MetadataError(f"{what} has dtype {short_repr(dtype)}; known: {', '.join(NAME_TO_DTYPE)}")
    owner = raw.get("owner_rank")
    if spec.shard_dim is None:
        if version is None:
            raise MetadataError(f"{what} is replicated, which the seed format cannot express")
        if not isinstance(owner, int) or isinstance(owner, bool) or not 0 <= owner < num_ranks:
            raise MetadataError(f"{what} is replicated and has owner_rank {short_repr(owner)}; expected "
                                f"0..{num_ranks - 1}. {_FIX}")
    return SavedTensor(spec, dtype, owner if spec.shard_dim is None else None)


def _chunked_tensor(source: str, name: str, raw: dict, num_ranks: int, version: int, bases: list[Base],
                    files: dict[str, FileRecord]) -> SavedTensor:
    what = f"{source}: tensor {short_repr(name)}"
    shape = expect_list(raw.get("full_shape"), f"{what}: full_shape", max_items=knobs.MAX_TENSOR_NDIM)
    spec = TensorShardSpec(tuple(expect_int(d, f"{what}: full_shape[{i}]") for i, d in enumerate(shape)), None, ())
    check_spec(name, spec, 1, source=source)
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in NAME_TO_DTYPE:
        raise MetadataError(f"{what} has dtype {short_repr(dtype)}; known: {', '.join(NAME_TO_DTYPE)}")
    if version == COMPACT_VERSION and "grid" in raw:
        if "chunks" in raw:
            raise MetadataError(f"{what} has both a grid and chunks; a tensor is described by one of them. {_FIX}")
        chunks = parse_grid(source, name, raw["grid"], spec.full_shape, num_ranks)
    else:
        chunks = parse_chunks(source, name, raw.get("chunks"), spec.full_shape,
                              itemsize_bytes(NAME_TO_DTYPE[dtype]),
                              lambda f, base: _data_file(source, f, num_ranks) if base is None
                              else base_file_key(source, f, base, bases, files, _FIX))
    split_dim = raw.get("shard_dim")
    if split_dim is not None:
        split_dim = expect_int(split_dim, f"{what}: shard_dim", high=max(0, len(spec.full_shape) - 1))
        if not spec.full_shape:
            raise MetadataError(f"{what} is a scalar but has shard_dim {split_dim}. {_FIX}")
    return SavedTensor(spec, dtype, None, chunks, split_dim, _split_sizes(what, raw, spec, split_dim, num_ranks))


def _split_sizes(what: str, raw: dict, spec: TensorShardSpec, split_dim: int | None,
                 num_ranks: int) -> tuple[int, ...] | None:
    """Version 3's optional ``shard_sizes`` of a split tensor without an element, checked."""
    if raw.get("shard_sizes") is None:
        return None
    sizes = expect_list(raw["shard_sizes"], f"{what}: shard_sizes", max_items=num_ranks)
    sizes = tuple(expect_int(s, f"{what}: shard_sizes[{i}]") for i, s in enumerate(sizes))
    if split_dim is None or len(sizes) != num_ranks or sum(sizes) != spec.full_shape[split_dim] \
            or math.prod(spec.full_shape):
        raise MetadataError(f"{what} has shard_sizes {list(sizes)[:8]}; they are written only beside a shard_dim, "
                            f"for a tensor without an element, one per rank ({num_ranks}), summing to that "
                            f"dimension. {_FIX}")
    return sizes


def _data_file(source: str, file: Any, num_ranks: int) -> str:
    digits = file[len("rank_"):-len(".safetensors")] if isinstance(file, str) else ""
    if not (digits.isdigit() and digits.isascii() and file == data_file_name(int(digits)) and int(digits) < num_ranks):
        raise MetadataError(f"{source} places a chunk in {file!r}; the data files of a checkpoint of {num_ranks} "
                            f"ranks are rank_0.safetensors .. rank_{num_ranks - 1}.safetensors")
    return file


def rank_manifest_json(rank: int, num_ranks: int, records: dict[str, FileRecord], save_id: str | None = None) -> dict:
    return {"format": RANK_FORMAT, "format_version": FORMAT_VERSION, "rank": rank, "num_ranks": num_ranks,
            "files": {f: r.to_json() for f, r in records.items()}, **({"save_id": save_id} if save_id else {})}


def read_rank_manifest(storage: Storage, directory: str, rank: int, num_ranks: int,
                       save_id: str | None = None) -> dict[str, FileRecord]:
    """The records in ``rank_<rank>.json``, checked against the rank, world and save it claims."""
    path = storage.join(directory, rank_manifest_name(rank))
    obj = _load_json(path, storage.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES))
    _check_version(path, obj, RANK_FORMAT)
    if obj.get("rank") != rank or obj.get("num_ranks") != num_ranks:
        raise IncompleteCheckpointError(
            f"{path} belongs to rank {short_repr(obj.get('rank'))} of {short_repr(obj.get('num_ranks'))}, expected rank {rank} "
            f"of {num_ranks}: it is left over from another save into the same directory"
        )
    if save_id is not None and obj.get("save_id") != save_id:
        raise IncompleteCheckpointError(
            f"{path} belongs to a different save than {METADATA_FILE} (save_id {short_repr(obj.get('save_id'))}, "
            f"expected {save_id!r}): an overwrite of this directory was interrupted, or, without a group, "
            f"the ranks passed different plain values or metadata (every rank must pass the same). "
            f"Load an earlier checkpoint; save each step to a new directory, or pass group="
        )
    files = expect_dict(obj.get("files"), f"{path}: files")
    return {check_relative_name(f, (".safetensors",), source=path): FileRecord.from_json(f, r)
            for f, r in files.items()}


def file_records(storage: Storage, directory: str, m: Manifest) -> dict[str, FileRecord]:
    """The record of every rank's data file, by file name ({} for a seed-format directory).

    Raises :class:`IncompleteCheckpointError` when a rank's record is nowhere
    (that rank never finished its save).
    """
    if m.format_version is None:
        return {}
    records = dict(m.files)
    for rank in range(m.num_ranks):
        name = data_file_name(rank)
        if name in records:
            continue
        if not storage.exists(storage.join(directory, rank_manifest_name(rank))):
            raise IncompleteCheckpointError(
                f"{directory}: neither {METADATA_FILE} nor {rank_manifest_name(rank)} records {name}: "
                f"rank {rank} never finished its save, so the checkpoint is incomplete"
            )
        records.update(read_rank_manifest(storage, directory, rank, m.num_ranks, m.save_id))
        if name not in records:
            raise IncompleteCheckpointError(f"{rank_manifest_name(rank)} does not record {name}")
    return records

"""Read a PyTorch DCP ``.metadata`` file without running code from it.

``torch.distributed.checkpoint`` writes its ``.metadata`` with ``pickle.dump``
and reads it back with a plain ``pickle.load`` (pytorch/pytorch#189308): a
crafted file runs any code it likes. Here the file goes through torch's
weights-only unpickler (``torch._weights_only_unpickler``, the one behind
``torch.load(weights_only=True)``), with only DCP's own metadata classes
admitted on top of its defaults (tensors' dtypes, ``torch.Size``, plain
containers) via ``torch.serialization.safe_globals``. That unpickler reads
protocol-2 opcodes only, so the protocol-4 stream is first rewritten opcode
for opcode (``pickle_downgrade``: a parser, it builds nothing). Any other global (say,
``os.system``) is refused before it is called, and the refusal is a
:class:`~shardkit.errors.MetadataError`. The unpickler admits DCP's classes
with any field values, so :func:`storage_locations` and :func:`chunk_boxes`
check the types of what the reader then uses. This module does not read
tensor data.

The common case is read faster the same way, in C: ``pickle.Unpickler``
whose ``find_class`` hands out only those same classes (and ``torch.Size``,
the torch dtypes, ``torch.serialization._get_layout``; any other global,
and any persistent id, is refused before anything is called), with the
opcode limit kept by taking only files of at most
``knobs.DCP_MAX_METADATA_OPS`` bytes. A file it does not turn into DCP
``Metadata`` (refused, malformed, another result) goes through the
restricted unpickler above, which decides and words the error. The
weights-only unpickler, in Python, with the opcode rewrite, took ~30 ms on
a 192 MB checkpoint's ``.metadata`` that plain ``pickle`` reads in 0.7 ms;
every rank of a load reads it.

Example::

    meta = read_dcp_metadata("/ckpt/dcp-step-100")
    meta.state_dict_metadata["model.w"].size      # torch.Size([4096, 1024])
"""

from __future__ import annotations

import io
import logging
import pathlib
import pickle

from typing import Any

from shardkit import knobs
from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError
from shardkit.layout import Box
from shardkit.sources.pickle_downgrade import downgrade_pickle
from shardkit.storage import storage_for
from shardkit.storage.json_io import expect_int, short_repr

__all__ = ["DCP_METADATA_FILE", "chunk_boxes", "dcp_metadata_classes", "int_tuple", "parse_dcp_metadata",
           "read_dcp_metadata", "storage_locations"]

DCP_METADATA_FILE = ".metadata"
log = logging.getLogger("shardkit.sources.dcp")


def dcp_metadata_classes() -> list:
    """The classes a DCP ``.metadata`` may construct beyond torch's weights-only defaults."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
               metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo]
    if hasattr(metadata, "StorageMeta"):
        classes.append(metadata.StorageMeta)
    # StorageMeta.checkpoint_id may be the path dcp.save was given: a path object is inert data.
    return classes + [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]


def parse_dcp_metadata(source: str, data: bytes):
    """Unpickle the bytes of a ``.metadata`` file (``source`` names it in errors): through the allowlisting C
    unpickler when it gives DCP ``Metadata``, else through the restricted unpickler, which decides."""
    import torch
    from torch import _weights_only_unpickler
    from torch.distributed.checkpoint.metadata import Metadata

    obj = _allowlisted_parse(data)
    if isinstance(obj, Metadata):
        return _checked(source, obj)
    try:
        with torch.serialization.safe_globals(dcp_metadata_classes()):
            obj = _weights_only_unpickler.load(io.BytesIO(downgrade_pickle(data, source=source)), encoding="utf-8")
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError,
            KeyError, RuntimeError, UnicodeDecodeError) as e:
        raise MetadataError(
            f"{source} was refused by the restricted unpickler: it holds something other than DCP's "
            f"metadata classes and plain containers (possibly code, which was not run), or it is corrupt. "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e
    if not isinstance(obj, Metadata):
        raise MetadataError(f"{source} holds a {type(obj).__name__}, not DCP Metadata; it is not a DCP checkpoint")
    return _checked(source, obj)


def _checked(source: str, obj):
    """``obj`` (a DCP ``Metadata``) when its ``state_dict_metadata`` is a dict keyed by str, else MetadataError."""
    if not isinstance(getattr(obj, "state_dict_metadata", None), dict):
        raise MetadataError(f"{source}: its Metadata has no state_dict_metadata dict; the file is corrupt")
    for fqn in obj.state_dict_metadata:
        if not isinstance(fqn, str):
            raise MetadataError(f"{source}: state_dict_metadata has the key {short_repr(fqn)} "
                                f"({type(fqn).__name__}); DCP's keys are str names. The file is corrupt")
    return obj


class _NotAllowed(Exception):
    """A global or persistent id the fast unpickler does not hand out."""


class _AllowlistUnpickler(pickle.Unpickler):
    """C ``pickle.Unpickler`` that resolves only the globals in ``allowed`` (``{(module, name): object}``)."""

    def __init__(self, file, allowed: dict):
        super().__init__(file, encoding="utf-8")
        self._allowed = allowed

    def find_class(self, module, name):
        found = self._allowed.get((module, name))
        if found is None:
            raise _NotAllowed(f"{module}.{name}")
        return found

    def persistent_load(self, pid):
        raise _NotAllowed("a persistent id")


def _allowed_globals() -> dict:
    import torch
    from torch.serialization import _get_layout

    allowed = {(c.__module__, c.__qualname__): c for c in dcp_metadata_classes()}
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout
    return allowed


def _allowlisted_parse(data: bytes):
    """The object ``data`` unpickles to through :class:`_AllowlistUnpickler`, or None when it is refused or
    fails in any way (the restricted unpickler then decides), or is longer than the opcode limit allows."""
    if len(data) > knobs.DCP_MAX_METADATA_OPS:  # every opcode is at least a byte: the limit holds
        return None
    try:
        return _AllowlistUnpickler(io.BytesIO(data), _allowed_globals()).load()
    except Exception as e:  # noqa: BLE001 - any failure: the restricted unpickler's turn, and its message
        log.debug("DCP metadata left to the restricted unpickler (%s: %s)", type(e).__name__, str(e)[:200])
        return None


def read_dcp_metadata(dir):
    """The parsed ``.metadata`` of the DCP checkpoint directory ``dir`` (no tensor data is read).

    Raises :class:`MissingShardError` when ``dir`` does not exist,
    :class:`IncompleteCheckpointError` when it has no ``.metadata`` (DCP writes
    it last), :class:`MetadataError` when it is refused or malformed.
    """
    storage, directory = storage_for(dir)
    if not storage.exists(directory):
        raise MissingShardError(f"checkpoint directory {directory} does not exist")
    path = storage.join(directory, DCP_METADATA_FILE)
    if not storage.exists(path):
        raise IncompleteCheckpointError(
            f"{directory} has no {DCP_METADATA_FILE}: the DCP save never finished (or this is not a DCP checkpoint)")
    log.debug("reading DCP metadata %s", path)
    return parse_dcp_metadata(path, storage.read_bytes(path, max_bytes=knobs.DCP_MAX_METADATA_BYTES))


def storage_locations(meta, source: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """``meta.storage_data`` as ``{(fqn, chunk offsets or None for a value): storage info}``.

    Checks each key (a ``MetadataIndex`` with a str ``fqn`` and int offsets
    or None), not the infos (the reader checks the fields it uses). None
    (no storage_data) is an empty dict.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    data = getattr(meta, "storage_data", None)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MetadataError(f"{source}: storage_data is {_found(data)}, not a dict of MetadataIndex -> storage "
                            f"info as DCP's FileSystemWriter writes; the metadata is corrupt or from another writer")
    where = {}
    for key, info in data.items():
        fqn = getattr(key, "fqn", None) if isinstance(key, MetadataIndex) else None
        if not isinstance(fqn, str):
            raise MetadataError(f"{source}: a storage_data key is {_found(key)}, not a MetadataIndex with a "
                                f"str fqn; the metadata is corrupt")
        offset = getattr(key, "offset", None)
        where[(fqn, None if offset is None else int_tuple(offset, f"{source}: storage_data's offset of {fqn!r}"))] = info
    return where


def chunk_boxes(entry, what: str) -> list[Box]:
    """The boxes of a ``TensorStorageMetadata``'s chunks (each a ``ChunkStorageMetadata`` of int offsets, sizes)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    boxes = []
    for chunk in _items(getattr(entry, "chunks", None), f"{what}: chunks"):
        if not isinstance(chunk, ChunkStorageMetadata):
            raise MetadataError(f"{what}: a chunk is {_found(chunk)}, not a ChunkStorageMetadata; "
                                f"the metadata is corrupt")
        boxes.append(Box(int_tuple(getattr(chunk, "offsets", None), f"{what}: a chunk's offsets"),
                         int_tuple(getattr(chunk, "sizes", None), f"{what}: a chunk's sizes")))
    return boxes


def int_tuple(value, what: str) -> tuple[int, ...]:
    """``value`` (a list, tuple or torch.Size) as a tuple of ints >= 0 (``expect_int`` each), else MetadataError."""
    import torch

    items = _items(value, what) if not isinstance(value, torch.Size) else list(value)
    return tuple(expect_int(v, what, high=2**63 - 1) for v in items)


def _items(value, what: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise MetadataError(f"{what} is {_found(value)}, not a list; the metadata is corrupt")
    return list(value)


def _found(value) -> str:
    """What an unexpected value is, for a message: its type, and its repr when short."""
    text = short_repr(value)
    return f"a value of type {type(value).__name__}" + (f" ({text})" if not text.endswith("...") else "")

"""Where a DCP chunk's tensor bytes lie inside its ``torch.save`` record, so they can be read in place.

A DCP tensor chunk is one ``torch.save`` record: a stored (uncompressed) zip
holding ``<archive>/data.pkl`` (the tensor's shape, strides, storage offset)
and ``<archive>/data/0`` (the storage bytes). When the pickle describes a
plain contiguous tensor of exactly the chunk's dtype and shape over the
whole of that one storage, little-endian, :func:`tensor_data_span` returns
the file range of the storage bytes: a reader then copies them straight into
its output, with no ``torch.load`` copy and no temporary. Anything else
(another layout, several storages, a compressed entry, a pickle the
weights-only unpickler refuses) returns None, and the caller falls back to
``torch.load(weights_only=True)``, which decides. Nothing here runs code
from the file: the pickle goes through torch's weights-only unpickler with
storages on the ``meta`` device (no bytes).

Example::

    span = tensor_data_span(record_stream, torch.float32, (8, 16))
    if span is not None:
        start, length, crc32 = span   # relative to the record's first byte
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from typing import BinaryIO

import torch

try:  # ISA-L's CRC-32: about 10 GiB/s on the 2-core benchmark VM, zlib's about 2.3
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal's wheels
    from zlib import crc32

__all__ = ["tensor_data_span", "check_record_crcs", "crc32"]

log = logging.getLogger("shardkit.sources.dcp")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_MAX_PICKLE_BYTES = 1 << 20


def tensor_data_span(record: BinaryIO, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(start, length, crc32)`` of the tensor's bytes within the record (the CRC-32 its zip entry
    records for them), or None when they cannot be read in place."""
    try:
        with zipfile.ZipFile(record) as z:
            infos = z.infolist()
            data = [i for i in infos if i.filename.split("/")[-2:-1] == ["data"]]
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(data) != 1 or len(pickles) != 1 or pickles[0].file_size > _MAX_PICKLE_BYTES:
                return None
            if any(i.compress_type != zipfile.ZIP_STORED for i in (data[0], pickles[0])):
                return None
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if order and z.read(order[0]).strip() != b"little":
                return None
            pkl = z.read(pickles[0])
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if data[0].file_size != nbytes or not _plain_tensor(pkl, dtype, shape, data[0].filename.split("/")[-1]):
            return None
        record.seek(data[0].header_offset)
        head = record.read(_LOCAL_HEADER.size)
        if len(head) != _LOCAL_HEADER.size:
            return None
        fields = _LOCAL_HEADER.unpack(head)
        if fields[0] != 0x04034B50:
            return None
        start = data[0].header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        return start, nbytes, data[0].CRC
    except Exception as e:  # any surprise: the caller's torch.load path decides
        log.debug("reading a DCP record through torch.load (%s: %s)", type(e).__name__, e)
        return None


def _plain_tensor(pkl: bytes, dtype: torch.dtype, shape: tuple[int, ...], key: str) -> bool:
    """Whether ``data.pkl`` is one contiguous ``dtype`` tensor of ``shape`` at offset 0 of storage ``key``.

    First through :class:`_DescribingUnpickler` (C, builds nothing: ~50x faster per record); what it does
    not recognise is judged by torch's weights-only unpickler."""
    try:
        described = _DescribingUnpickler(io.BytesIO(pkl)).load()
    except Exception as e:  # noqa: BLE001 - not the plain layout it knows: the weights-only unpickler decides
        log.debug("data.pkl left to the weights-only unpickler (%s: %s)", type(e).__name__, str(e)[:200])
        described = None
    if isinstance(described, _Described) and described.plain(dtype, shape, key):
        return True
    return _plain_tensor_weights_only(pkl, dtype, shape, key)


class _NotAllowed(Exception):
    """A global the describing unpickler does not hand out."""


class _Described:
    """What ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` was asked to build."""

    def __init__(self, storage, offset, size, stride, *rest):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def plain(self, dtype: torch.dtype, shape: tuple[int, ...], key: str) -> bool:
        """One contiguous ``dtype`` tensor of ``shape`` at offset 0 over the whole of storage ``key``."""
        storage_dtype, storage_key, numel = self.storage
        expected = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return (storage_dtype == dtype and storage_key == key and self.offset == 0 and numel == math.prod(shape)
                and tuple(self.size) == tuple(shape) and tuple(self.stride) == tuple(expected))


class _DescribingUnpickler(pickle.Unpickler):
    """C unpickler for a ``torch.save`` record's ``data.pkl`` that builds no tensor: ``_rebuild_tensor_v2``
    becomes :class:`_Described`, a storage ``(dtype, key, numel)``; any other global is refused."""

    def __init__(self, file):
        super().__init__(file, encoding="utf-8")

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Described
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        dtype = _storage_dtypes().get(name) if module == "torch" else None
        if dtype is None:
            raise _NotAllowed(f"{module}.{name}")
        return dtype  # a storage class stands for its dtype

    def persistent_load(self, saved_id):
        kind, storage_type, key, _, numel = saved_id
        if kind != "storage":
            raise _NotAllowed(f"persistent id {kind!r}")
        dtype = storage_type if isinstance(storage_type, torch.dtype) else storage_type.dtype
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int):
            raise _NotAllowed("a storage without a dtype or an int size")
        return dtype, key, numel


_STORAGE_DTYPES: dict[str, torch.dtype] = {}


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: torch's legacy storage classes by name (found once)."""
    if not _STORAGE_DTYPES:
        with warnings.catch_warnings():  # a legacy storage class's dtype warns that TypedStorage is deprecated
            warnings.simplefilter("ignore")
            for name, value in vars(torch).items():
                dtype = getattr(value, "dtype", None) if name.endswith("Storage") and isinstance(value, type) else None
                if isinstance(dtype, torch.dtype):
                    _STORAGE_DTYPES[name] = dtype
    return _STORAGE_DTYPES


def _plain_tensor_weights_only(pkl: bytes, dtype: torch.dtype, shape: tuple[int, ...], key: str) -> bool:
    """:func:`_plain_tensor` through torch's weights-only unpickler (storages on the meta device)."""
    from torch._weights_only_unpickler import Unpickler

    seen = []

    def persistent_load(saved_id):
        _, storage_type, storage_key, _, numel = saved_id
        seen.append(storage_key)
        storage_dtype = storage_type.dtype if hasattr(storage_type, "dtype") else storage_type
        untyped = torch.UntypedStorage(numel * torch.empty((), dtype=storage_dtype).element_size(), device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=storage_dtype, _internal=True)

    unpickler = Unpickler(io.BytesIO(pkl), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    t = unpickler.load()
    return (isinstance(t, torch.Tensor) and seen == [key] and t.dtype == dtype and tuple(t.shape) == tuple(shape)
            and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def check_record_crcs(record: bytes) -> str | None:
    """The name of the first entry of the ``torch.save`` record ``record`` whose bytes do not match
    their zip CRC-32, or None (an unreadable zip is left to ``torch.load`` to refuse)."""
    try:
        with zipfile.ZipFile(io.BytesIO(record)) as z:
            return z.testzip()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError):
        return None

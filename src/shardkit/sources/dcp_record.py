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
import struct
import zipfile
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
    """Whether ``data.pkl`` is one contiguous ``dtype`` tensor of ``shape`` at offset 0 of storage ``key``."""
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

"""PyTorch ``.bin`` shards: write with ``torch.save``, read only with ``torch.load(weights_only=True)``.

A ``.bin`` file is a pickle. shardkit never unpickles one with the full
unpickler: a file that asks for anything but tensors and plain containers
(a pickle that carries code) is refused with ``MetadataError`` and nothing in
it runs. Prefer safetensors; this exists to read and write checkpoints that
other tools expect as ``.bin``.

Example::

    write_bin_shard(store, path, {"w": w})
    tensors = read_bin_shard(store, path)      # {"w": tensor}
"""

from __future__ import annotations

import zipfile

import torch

from shardkit.errors import CheckpointIOError, MetadataError, MissingShardError
from shardkit.hf.untrusted import PARSE_FAILURES, hostile_input, require_regular_file
from shardkit.storage import Storage

__all__ = ["write_bin_shard", "read_bin_shard", "bin_looks_complete"]


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes whole storages; a view of a larger one would drag it all along.
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def write_bin_shard(storage: Storage, path: str, tensors: dict[str, torch.Tensor], durable: bool = True) -> None:
    """Write ``tensors`` as a ``torch.save`` zip file at ``path``, atomically (fsync'd if ``durable``)."""
    with storage.atomic_writer(path, durable) as f:
        torch.save({n: _own_storage(t) for n, t in tensors.items()}, f)


def read_bin_shard(storage: Storage, path: str) -> dict[str, torch.Tensor]:
    """All tensors in the ``.bin`` file at ``path``, on CPU, via the restricted unpickler.

    Raises ``MetadataError`` for a file that is not a tensor dict or that
    holds anything the weights-only unpickler refuses.
    """
    require_regular_file(storage, path)
    try:
        with storage.open_file(path) as source:
            _check_zip_members(path, source, storage.size_bytes(path))
            source.seek(0)
            obj = torch.load(source, map_location="cpu", weights_only=True)
    except (MemoryError, PermissionError, MetadataError, CheckpointIOError):
        raise  # CheckpointIOError: the store failed while reading; the file was not judged
    except Exception as e:  # noqa: BLE001 -- a damaged pickle/zip fails in many ways; all mean "refused"
        raise MetadataError(
            f"{path} was refused by torch.load(weights_only=True): it holds objects other than "
            f"tensors and plain containers (possibly code), or it is corrupt. shardkit never runs "
            f"the full unpickler. If you trust the file, convert it yourself; otherwise delete it. "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise MetadataError(
            f"{path} holds a {type(obj).__name__}, not a dict of name -> tensor; it is not a "
            f"PyTorch weights shard"
        )
    return obj


def _check_zip_members(path: str, source, size_bytes: int) -> None:
    """Refuse a zip ``.bin`` whose members are compressed or add up past the file: ``torch.save``
    stores them uncompressed, so anything else could inflate far beyond the file (a zip bomb)."""
    with hostile_input(path, fix="it is not a torch.save file; delete it or restore it"):
        if not _is_zip(source):
            return  # a legacy (pre-1.6) torch.save pickle: torch.load checks it
        with zipfile.ZipFile(source) as z:
            members = z.infolist()
    packed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    unpacked_bytes = sum(m.file_size for m in members)
    if packed or unpacked_bytes > size_bytes:
        raise MetadataError(
            f"{path} is a zip whose members unpack to {unpacked_bytes:,} bytes from a {size_bytes:,}-byte "
            f"file ({len(packed)} compressed, e.g. {packed[:2]}); torch.save never compresses, so this "
            f"is not a file it wrote (possibly a zip bomb). Delete it or restore it."
        )


def _is_zip(source) -> bool:
    """Whether the file object ``source`` starts like a zip (its position is left at the start)."""
    source.seek(0)
    magic = source.read(2)
    source.seek(0)
    return magic == b"PK"


def bin_looks_complete(storage: Storage, path: str) -> bool:
    """True if ``path`` is a ``torch.save`` zip whose central directory reads back intact.

    Unpickles nothing and reads only the zip directory (its end, on object stores). A
    legacy (non-zip) ``.bin`` counts when it is not empty.
    """
    try:
        require_regular_file(storage, path)
        with storage.open_reader(path) as reader:
            if reader.size_bytes == 0:
                return False
            if reader.read(0, 2) != b"PK":
                return True
        with storage.open_file(path) as source, zipfile.ZipFile(source) as z:
            return len(z.namelist()) > 0
    except (OSError, MetadataError, MissingShardError, *PARSE_FAILURES):
        return False

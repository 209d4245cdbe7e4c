"""Bytes and files: atomic publish, safetensors headers and ranges, checksums.

This layer knows files and bytes only. It never decides which tensor bytes
a rank needs; ``shardkit.checkpoint`` plans that and calls in here.
"""

from shardkit.storage.atomic import atomic_local_writer, fsync_dir, is_temp_name, start_writeback, temp_name
from shardkit.storage.backend import (
    BufferReader, FsspecStorage, LocalStorage, Reader, Storage, file_url_path, storage_for,
)
from shardkit.storage.base import StreamSink
from shardkit.storage.fsspec_store import fetched_bytes
from shardkit.storage.lock import is_lock_name
from shardkit.storage.checksum import ALGORITHM, BlockHasher, FileRecord, new_block_hasher
from shardkit.storage.json_io import parse_json_object
from shardkit.storage.parallel import run_parallel
from shardkit.storage.paths import check_relative_name
from shardkit.storage.safetensors_header import (
    FileLayout,
    SafetensorsHeader,
    TensorEntry,
    build_header,
    file_layout,
    parse_header,
    read_header,
)
from shardkit.storage.tensor_io import byte_view, read_ranges
from shardkit.storage.writer import LazyTensor, TensorLike, write_safetensors

__all__ = [
    "ALGORITHM",
    "BlockHasher",
    "BufferReader",
    "FileLayout",
    "FileRecord",
    "FsspecStorage",
    "LazyTensor",
    "LocalStorage",
    "Reader",
    "SafetensorsHeader",
    "Storage",
    "StreamSink",
    "TensorEntry",
    "atomic_local_writer",
    "build_header",
    "byte_view",
    "check_relative_name",
    "fetched_bytes",
    "file_layout",
    "file_url_path",
    "fsync_dir",
    "is_lock_name",
    "is_temp_name",
    "new_block_hasher",
    "parse_header",
    "parse_json_object",
    "read_header",
    "read_ranges",
    "run_parallel",
    "start_writeback",
    "storage_for",
    "temp_name",
    "TensorLike",
    "write_safetensors",
]

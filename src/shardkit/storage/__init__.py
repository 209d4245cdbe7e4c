"""Bytes and files: atomic publish, safetensors headers and ranges, checksums.

This layer knows files and bytes only. It never decides which tensor bytes
a rank needs; ``shardkit.checkpoint`` plans that and calls in here. By job:
``backends/`` (where bytes live: the ``Storage`` / ``Reader`` interface, local
files, fsspec stores, ``storage_for``), ``fast_io/`` (memory and I/O
mechanics: cache-bypassing copies, prefaulting, ``O_DIRECT``, mapped-page
prefetch, the I/O thread pool), ``safetensors_format/`` (the file format:
header, writer, verified reads); here: block checksums, untrusted JSON and
plain values. The names below are the package's public surface, each from
the module that defines it.
"""

from shardkit.lazy_names import lazy_names

#: Where each name lives. Loaded on first use (PEP 562), so that importing one
#: light submodule (``storage.json_io`` for the CLI's ``--help``) does not
#: import torch through the safetensors and tensor modules.
_HOMES = {
    "backends.atomic": ["atomic_local_writer", "fsync_dir", "is_temp_name", "start_writeback", "temp_name"],
    "backends.base": ["BufferReader", "Reader", "Storage", "StreamSink"],
    "backends.choose": ["file_url_path", "storage_for"],
    "backends.fsspec_readers": ["fetched_bytes"],
    "backends.fsspec_store": ["FsspecStorage"],
    "backends.local": ["LocalStorage"],
    "backends.lock": ["is_lock_name"],
    "backends.paths": ["check_relative_name"],
    "checksum": ["ALGORITHM", "BlockHasher", "FileRecord", "new_block_hasher"],
    "json_io": ["parse_json_object"],
    "fast_io.parallel": ["run_parallel"],
    "safetensors_format.header": ["FileLayout", "SafetensorsHeader", "TensorEntry", "build_header", "file_layout",
                                  "parse_header", "read_header"],
    "safetensors_format.tensor_io": ["byte_view", "read_ranges"],
    "safetensors_format.writer": ["LazyTensor", "TensorLike", "write_safetensors"],
}

__getattr__, __dir__, __all__ = lazy_names(__name__, globals(), _HOMES)

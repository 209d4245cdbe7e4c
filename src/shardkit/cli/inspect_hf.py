"""``shardkit inspect`` of a Hugging Face checkpoint: tensors, files and tied names, from headers only.

Safetensors shards: each tensor's dtype and shape come from its file's
header (no tensor bytes are read). ``.bin`` shards are pickles: only their
names (from the index) are listed, never unpickled, except a single
``pytorch_model.bin``, which is read with ``torch.load(weights_only=True)``.

Example::

    summary = hf_summary("out/model")      # {"path", "format", "tensors": [...], "files": {...}, ...}
"""

from __future__ import annotations

import math

from shardkit.dtypes import NAME_TO_DTYPE, to_safetensors_name

__all__ = ["hf_summary", "print_hf_summary"]


def hf_summary(path: str) -> dict:
    """What the Hugging Face checkpoint in ``path`` holds; typed shardkit errors for a bad one."""
    from shardkit.hf.bin_io import read_bin_shard
    from shardkit.hf.directory import get_checkpoint_metadata
    from shardkit.hf.index import load_shard_index, sharing_of
    from shardkit.hf.shard_io import shard_header
    from shardkit.storage import storage_for

    meta = get_checkpoint_metadata(path)
    store, root = storage_for(path)
    index = load_shard_index(path, meta.file_name) if meta.is_index else None
    files = list(dict.fromkeys(index["weight_map"].values())) if index else [meta.file_name]
    rows = []
    for file_name in files:
        file_path = store.join(root, file_name)
        if meta.safetensors:
            for name, e in shard_header(store, file_path).tensors.items():
                rows.append(_row(name, e.dtype, list(e.shape), file_name))
        elif index is None:
            for name, t in read_bin_shard(store, file_path).items():
                rows.append(_row(name, to_safetensors_name(t.dtype), list(t.shape), file_name))  # "F32", as headers
        else:
            rows += [_row(n, "?", None, f) for n, f in index["weight_map"].items() if f == file_name]
    extra = {k: v for k, v in (index or {}).get("metadata", {}).items() if k not in ("total_size", "param_sharing")}
    return {
        "path": path,
        "format": "huggingface",
        "weights": "safetensors" if meta.safetensors else "pytorch .bin",
        "index": meta.file_name if meta.is_index else None,
        "tensors": sorted(rows, key=lambda r: r["name"]),
        "files": {f: store.size_bytes(store.join(root, f)) for f in files},
        "param_sharing": sharing_of(index) if index else [],
        "metadata": extra,
    }


def _row(name: str, dtype: str, shape, file_name: str) -> dict:
    itemsize = NAME_TO_DTYPE[dtype].itemsize if dtype in NAME_TO_DTYPE else None
    nbytes = math.prod(shape) * itemsize if itemsize is not None and shape is not None else None
    return {"name": name, "dtype": dtype, "shape": shape, "bytes": nbytes, "file": file_name}


def print_hf_summary(s: dict) -> None:
    layout = f"sharded ({len(s['files'])} file(s), {s['index']})" if s["index"] else "single file"
    total = sum(r["bytes"] or 0 for r in s["tensors"])
    print(f"{s['path']}: Hugging Face checkpoint, {s['weights']}, {layout}")
    unknown = sum(r["bytes"] is None for r in s["tensors"])
    sizes = f"{total:,} bytes in all" if not unknown else f"{unknown} of unknown size (in .bin shards)"
    print(f"{len(s['tensors'])} tensor(s), {sizes}")
    width = max((len(r["name"]) for r in s["tensors"]), default=4)
    for r in s["tensors"]:
        shape = "?" if r["shape"] is None else str(r["shape"])
        print(f"  {r['name']:<{width}}  {r['dtype']:<6} {shape:<18} {r['file']}")
    print("files:")
    for name, size in s["files"].items():
        print(f"  {name:<36} {size:>14,} bytes")
    if s["param_sharing"]:
        print(f"tied (stored once): {s['param_sharing']}")
    if s["metadata"]:
        import json

        print(f"metadata: {json.dumps(s['metadata'], ensure_ascii=False)[:2000]}")

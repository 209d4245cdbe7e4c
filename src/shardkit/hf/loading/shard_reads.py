"""Read the tensors a Hugging Face checkpoint's index places in its files, file by file.

Safetensors files are read into given tensors where they fit (a CPU tensor of the same dtype and shape:
no intermediate copy), else into fresh CPU tensors or, with ``mmap``, tensors over maps of the files;
``.bin`` files only through ``torch.load(weights_only=True)`` (``bin_io``), and before any safetensors
file, so a failure leaves the targets untouched. Not here: which names to read, ties, installing into a
module (``load.py``).

Example::

    tensors = read_files("out/model", index.weight_map, ["lm_head.weight"], safetensors=True, debug=False)
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from shardkit.dtypes import from_safetensors_name
from shardkit.errors import MissingShardError
from shardkit.hf.bin_io import read_bin_shard
from shardkit.hf.index import files_to_names
from shardkit.hf.loading.load_checks import require_shard
from shardkit.hf.shard_io import map_shard, read_shard
from shardkit.storage import storage_for

__all__ = ["read_files"]


def read_files(model_dir, weight_map, names, safetensors, debug, targets=None, mmap=False) -> Dict[str, Tensor]:
    """Read ``names`` file by file; into ``targets[name]`` where given, else fresh CPU tensors
    (or, with ``mmap``, tensors over maps of the files)."""
    store, root = storage_for(model_dir)
    out: Dict[str, Tensor] = {}
    # .bin files first: they are read into fresh memory, so a failure in one leaves the module untouched.
    for file_name, in_file in sorted(files_to_names(weight_map, names).items(), key=_is_safetensors):
        path = store.join(root, file_name)
        if debug:
            print(f"shardkit.hf: reading {len(in_file)} tensors from {path}")
        require_shard(store, path, file_name, model_dir)
        # The extension decides (the index check allows only the expected one), so a
        # wrong ``safetensors=`` flag cannot send a safetensors file to torch.load.
        if file_name.endswith(".safetensors"):
            out.update(_read_safetensors(store, path, in_file, targets or {}, mmap))
        else:
            out.update(_read_bin(path, store, in_file))
    return out


def _is_safetensors(file_and_names) -> bool:
    return file_and_names[0].endswith(".safetensors")


def _read_safetensors(store, path, names, targets, mmap) -> Dict[str, Tensor]:
    if mmap and not targets:
        mapped = map_shard(store, path, names)
        if mapped is not None:
            return mapped

    def buffer_for(name, entry):
        target = targets.get(name)
        if target is not None and _fits(target, entry):
            return target.detach()  # read straight into the module's memory
        return torch.empty(entry.shape, dtype=from_safetensors_name(entry.dtype))

    return read_shard(store, path, names, buffer_for)


def _fits(target: Tensor, entry) -> bool:
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and tuple(target.shape) == tuple(entry.shape)
        and target.dtype == from_safetensors_name(entry.dtype)
    )


def _read_bin(path, store, names) -> Dict[str, Tensor]:
    tensors = read_bin_shard(store, path)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise MissingShardError(f"the index places {missing[:5]} in {path}, but the file does not hold them")
    return {n: tensors[n] for n in names}

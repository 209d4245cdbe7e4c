"""The one writer of Hugging Face shard files, configs and index, for every HF save and export.

``save_checkpoint`` (one process, or each rank of a job), ``distributed_to_hf``
and ``shardkit convert --to hf`` all write through here: each shard is
published whole or not at all (``write_safetensors`` with ``{"format": "pt"}``,
or ``torch.save`` for ``.bin``), tensors are produced one at a time (a
:class:`~shardkit.storage.LazyTensor` is loaded just before its bytes are
written), and the index comes last, after the configs, so a directory counts
as a checkpoint only once it is whole. Not here: deciding what goes where
(``export_plan``), where bytes come from (the callers), locking.

Example::

    plan = plan_export(sizes, 1, 2**31)
    write_export(store, root, plan.files, lazy_for, index_data, {"config.json": b"{}"}, safetensors=True)
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Mapping, Sequence

import torch

from shardkit.dtypes import to_safetensors_name
from shardkit.errors import MetadataError
from shardkit.hf.bin_io import write_bin_shard
from shardkit.hf.index import BIN_INDEX_NAME, SAFE_INDEX_NAME, index_file_name, index_json
from shardkit.hf.model_config import write_model_config_files
from shardkit.storage import LazyTensor, TensorLike, file_layout, write_safetensors

__all__ = ["write_order", "write_shard_file", "write_files", "write_tail", "write_export", "remove_previous",
           "export_index", "cast_lazy"]

_SHARD_RE = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)$")
#: The tensor names of one shard file, in a ``(file name, names)`` pair.
FileNames = Sequence[str]


def write_order(names: Sequence[str], dtype_of: Callable[[str], torch.dtype],
                shape_of: Callable[[str], Sequence[int]]) -> list[str]:
    """``names`` in the order :func:`write_shard_file` produces (loads) them: the safetensors file layout's.

    A producer that fills tensors ahead of the writer (another rank, a
    read-ahead thread) must fill them in this order. Pure.
    """
    layout = file_layout([(n, to_safetensors_name(dtype_of(n)), tuple(shape_of(n))) for n in names], None)
    return [names[i] for i in layout.order]


def write_shard_file(store, path: str, named: Sequence[tuple[str, TensorLike]], safetensors: bool, *,
                     durable: bool = True, debug: bool = False) -> None:
    """Write one shard of ``named`` tensors at ``path``, atomically; lazy ones are loaded in :func:`write_order`.

    A ``.bin`` shard is built in memory (one shard, not the model), as ``torch.save`` needs.
    """
    if debug:
        print(f"shardkit.hf: writing {len(named)} tensors to {path}")
    if safetensors:
        write_safetensors(store, path, list(named), {"format": "pt"}, checksum=False, durable=durable)
        return
    by_name = dict(named)
    order = write_order(list(by_name), lambda n: by_name[n].dtype, lambda n: by_name[n].shape)
    tensors = {n: by_name[n].load() if isinstance(by_name[n], LazyTensor) else by_name[n] for n in order}
    write_bin_shard(store, path, tensors, durable)


def write_files(store, root: str, files: Sequence[tuple[str, FileNames]], lazy_for: Callable[[str], TensorLike],
                safetensors: bool, *, durable: bool = True, debug: bool = False) -> None:
    """Write each ``(file name, names)`` shard in ``root``; ``lazy_for(name)`` gives each tensor (or lazy one)."""
    for file_name, names in files:
        write_shard_file(store, store.join(root, file_name), [(n, lazy_for(n)) for n in names], safetensors,
                         durable=durable, debug=debug)


def write_tail(store, root: str, index_data: bytes, safetensors: bool, configs: Mapping[str, bytes], *,
               durable: bool = True) -> None:
    """Publish the configs, then the index (``index_data`` from :func:`export_index`): the commit, last."""
    write_model_config_files(store, root, dict(configs), durable)
    with store.atomic_writer(store.join(root, index_file_name(safetensors)), durable) as f:
        f.write(index_data)


def write_export(store, root: str, files: Sequence[tuple[str, FileNames]], lazy_for: Callable[[str], TensorLike],
                 index_data: bytes, configs: Mapping[str, bytes], safetensors: bool, *, durable: bool = True,
                 debug: bool = False) -> None:
    """Every shard (:func:`write_files`), then configs and index (:func:`write_tail`): one process's whole export."""
    store.makedirs(root)
    write_files(store, root, files, lazy_for, safetensors, durable=durable, debug=debug)
    write_tail(store, root, index_data, safetensors, configs, durable=durable)


def export_index(weight_map: Dict[str, str], nbytes_of: Mapping[str, int], metadata: Mapping | None,
                 sharing: Sequence[Sequence[str]] | None, safetensors: bool) -> bytes:
    """The checked index bytes (``MetadataError`` for metadata the loaders would refuse); writes nothing.

    ``total_size`` counts the stored tensors (``nbytes_of`` in the exported
    dtype); ``sharing`` groups go to ``param_sharing``, as ``make_shard_index`` records them.
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise MetadataError(f"metadata must be a dict (or None), got {type(metadata).__name__}: {str(metadata)[:80]}")
    meta = {"total_size": sum(nbytes_of[n] for n in weight_map), **(metadata or {})}
    if sharing:
        meta["param_sharing"] = [list(g) for g in sharing]
    return index_json({"metadata": meta, "weight_map": dict(weight_map)}, index_file_name(safetensors))


def remove_previous(store, root: str) -> None:
    """Remove the HF checkpoint in ``root``: its index first (from then on it is not a checkpoint), then shards.

    Other files (configs, a tokenizer, metrics) are left alone.
    """
    for name in (SAFE_INDEX_NAME, BIN_INDEX_NAME):
        path = store.join(root, name)
        if store.exists(path):
            store.remove(path)
    if not store.exists(root):
        return
    for name in store.listdir(root):
        if _SHARD_RE.match(name):
            store.remove(store.join(root, name))


def cast_lazy(tensor: torch.Tensor, dtype: torch.dtype) -> TensorLike:
    """``tensor`` as written in ``dtype``: itself when it already is, else a lazy cast made when written."""
    if tensor.dtype == dtype:
        return tensor
    return LazyTensor(dtype, tuple(tensor.shape), lambda: tensor.detach().to(dtype))

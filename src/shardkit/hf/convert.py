"""Convert between a shardkit distributed checkpoint and a Hugging Face one, tensor by tensor.

Distributed -> HF: the index is planned from ``metadata.json`` alone (names,
full shapes, dtypes); each shard file is then streamed one whole tensor at a
time (read through one ``open_checkpoint``: the manifest once, each data
file opened once; written, dropped), so memory stays around the largest
tensor, never the model. The index is written last, under the writer lock.

HF -> distributed: the HF shards are memory-mapped (file-backed pages the
kernel can drop, not copies) and handed to ``save_distributed`` as one rank
with every tensor replicated; it loads on any world size. To get a sharded
layout, load it and save again with a ``shard_spec``. Not here: configs,
tokenizers, optimizer state.

Example::

    distributed_to_hf("ckpt/step-100", "export/step-100", max_shard_size=2**30)
    hf_to_distributed("export/step-100", "ckpt/imported")
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Union

import torch

from shardkit.checkpoint.read_path import open_checkpoint
from shardkit.checkpoint.validate import data_problems
from shardkit.dtypes import from_safetensors_name
from shardkit.layout import whole_box
from shardkit.errors import IncompleteCheckpointError, MetadataError, TensorMismatchError
from shardkit.hf.bin_io import read_bin_shard
from shardkit.hf.index import (
    files_to_names,
    index_file_name,
    index_json,
    load_shard_index,
    plan_shards,
    shard_file_name,
    shard_size_bytes,
    write_index_json,
)
from shardkit.hf.save import _remove_previous
from shardkit.hf.shard_io import shard_header
from shardkit.hf.untrusted import hostile_input, non_regular_problems
from shardkit.storage import LazyTensor, write_safetensors
from shardkit.storage import storage_for

__all__ = ["distributed_to_hf", "hf_to_distributed", "load_distributed_flat"]


def distributed_to_hf(
    dist_dir: str,
    hf_dir: str,
    *,
    safetensors: bool = True,
    max_shard_size: Union[int, str] = 2**31,
    metadata: Optional[Dict] = None,
) -> None:
    """Write the full (unsharded) tensors of the distributed checkpoint ``dist_dir`` as an HF checkpoint.

    Non-tensor leaves of the saved state go to ``metadata["shardkit_objects"]``
    in the index. With ``safetensors=False`` each ``.bin`` shard is built in
    memory (a shard, not the model).

    Every byte of the source is hashed against its checksums before an HF
    checkpoint already in ``hf_dir`` is replaced: a damaged source raises
    ``IncompleteCheckpointError`` (a missing file ``MissingShardError``) and
    leaves ``hf_dir`` as it was. That is one extra read of the source.
    ``max_shard_size``: bytes, or a string such as ``"5GB"`` (as for
    ``save_checkpoint``). A bad size, or ``metadata`` the index cannot hold
    and read back (a numpy scalar, NaN), raises ``MetadataError`` before
    ``hf_dir`` is touched.
    """
    max_shard_bytes = shard_size_bytes(max_shard_size)
    store, root = storage_for(dist_dir)
    not_files = non_regular_problems(store, root)
    if not_files:
        raise MetadataError(f"{dist_dir}: {not_files[0]}")
    with hostile_input(dist_dir, fix="the distributed checkpoint is damaged; convert an earlier one"):
        source = open_checkpoint(dist_dir)
    with source:  # one manifest read, each data file opened once for the whole conversion
        _refuse_damaged(source, dist_dir, hf_dir)
        lazy: Dict[str, LazyTensor] = {}
        for name, saved in source.manifest.tensors.items():
            shape = tuple(saved.spec.full_shape)
            load = (lambda n=name, s=shape: source.region(n, [0] * len(s), list(s)))
            lazy[name] = LazyTensor(source.dtype(name), shape, load)
        plan = plan_shards([(n, t.nbytes) for n, t in lazy.items()], max_shard_bytes)
        weight_map = {n: shard_file_name(i + 1, len(plan), safetensors) for i, names in enumerate(plan) for n in names}
        index_data = index_json({"metadata": _converted_meta(lazy, source, metadata), "weight_map": weight_map},
                                index_file_name(safetensors))  # refused here, before hf_dir changes
        store, root = storage_for(hf_dir)
        with store.writer_lock(root, holder="shardkit.hf.distributed_to_hf"):
            _remove_previous(store, root)
            for file_name, names in files_to_names(weight_map, weight_map).items():
                _write_converted(store, store.join(root, file_name), {n: lazy[n] for n in names}, safetensors)
            write_index_json(index_data, hf_dir, index_file_name(safetensors))


def _converted_meta(lazy: Dict[str, LazyTensor], source, metadata: Optional[Dict]) -> dict:
    if metadata is not None and not isinstance(metadata, dict):
        raise MetadataError(f"metadata must be a dict (or None), got {type(metadata).__name__}: {str(metadata)[:80]}")
    meta = {"total_size": sum(t.nbytes for t in lazy.values()), **(metadata or {})}
    if source.manifest.objects:
        meta["shardkit_objects"] = source.manifest.objects
    return meta


def _refuse_damaged(source, dist_dir: str, hf_dir: str) -> None:
    """Hash every data file of the open ``source`` against its record before ``hf_dir`` is touched."""
    files = source.files()
    for name, record in source.records.items():
        problems = data_problems(files.get(name)[0], name, record)
        if problems:
            raise IncompleteCheckpointError(f"{dist_dir} is damaged: {problems[0]}. Nothing in {hf_dir} was "
                                            f"touched; convert an earlier checkpoint.")


def _write_converted(store, path: str, tensors: Dict[str, LazyTensor], safetensors: bool) -> None:
    if safetensors:
        write_safetensors(store, path, list(tensors.items()), {"format": "pt"}, checksum=False)
    else:
        from shardkit.hf.bin_io import write_bin_shard

        write_bin_shard(store, path, {n: t.load() for n, t in tensors.items()})


def load_distributed_flat(dist_dir: str, keys=None) -> Dict[str, torch.Tensor]:
    """The full tensors of a distributed checkpoint by flat dotted name (only ``keys`` if given)."""
    with open_checkpoint(dist_dir) as source:
        tensors = source.manifest.tensors
        names = list(tensors) if keys is None else list(keys)
        unknown = [n for n in names if n not in tensors]
        if unknown:
            raise TensorMismatchError(f"keys {sorted(unknown)[:10]} are not tensors of the checkpoint in {dist_dir}")
        return source.boxes({n: whole_box(tensors[n].spec.full_shape) for n in names})


def hf_to_distributed(
    hf_dir: str,
    dist_dir: str,
    *,
    world_size: int = 1,
    shard_spec=None,
    metadata: Optional[Dict] = None,
) -> None:
    """Save the HF checkpoint in ``hf_dir`` as a distributed checkpoint in ``dist_dir``.

    Writes the files of all ``world_size`` ranks from this one process, each
    rank's slice a view of the mapped HF shards (``shard_spec`` as for
    ``save_distributed``; ``None``: every tensor replicated). Tied names
    (``param_sharing``) are saved under their stored name only.

    Before anything is written: ``world_size`` below 1 or a ``shard_spec``
    that is not a layout for ``world_size`` ranks (sizes not summing to the
    dimension, a ``shard_dim`` past the tensor's dimensions, built for
    another world size) raises ``MetadataError``; a spec whose tensor the
    checkpoint lacks, or whose ``full_shape`` differs from the saved one,
    raises ``TensorMismatchError``.
    """
    from shardkit.checkpoint import save_distributed
    from shardkit.checkpoint.spec import as_spec_dict, check_world
    from shardkit.hf.directory import get_checkpoint_metadata

    check_world(0, world_size)
    specs = as_spec_dict(shard_spec, world_size)
    meta = get_checkpoint_metadata(hf_dir)
    if meta is None or meta.distributed:
        raise MetadataError(f"{hf_dir} holds no Hugging Face checkpoint to convert")
    if meta.is_index:
        weight_map = load_shard_index(hf_dir, meta.file_name)["weight_map"]
    else:
        weight_map = None
    store, root = storage_for(hf_dir)
    files = [meta.file_name] if weight_map is None else list(dict.fromkeys(weight_map.values()))
    state: Dict[str, torch.Tensor] = {}
    for file_name in files:
        path = store.join(root, file_name)
        found = _mapped_safetensors(store, path) if meta.safetensors else read_bin_shard(store, path)
        # Only what the index places in this file: another file's name here is a stale copy.
        state.update(found if weight_map is None else {n: t for n, t in found.items() if weight_map.get(n) == file_name})
    if weight_map is not None:
        absent = [n for n in weight_map if n not in state]
        if absent:
            raise MetadataError(
                f"the index in {hf_dir} places {len(absent)} tensor(s) in shards that lack them, e.g. "
                f"{absent[:3]}; the index and shards do not match -- re-save or restore the checkpoint"
            )
        state = {n: state[n] for n in weight_map}
    _check_specs_fit(specs, state, hf_dir)
    for rank in reversed(range(world_size)):  # rank 0 commits metadata.json; let it go last
        local = {n: _rank_view(t, specs.get(n), rank) for n, t in state.items()}
        save_distributed(local, dist_dir, rank, world_size, shard_spec, metadata=metadata)


def _check_specs_fit(specs: dict, state: Dict[str, torch.Tensor], hf_dir: str) -> None:
    """Raise ``TensorMismatchError`` for a spec naming a tensor ``state`` lacks or giving it another shape."""
    for name, spec in specs.items():
        if name not in state:
            raise TensorMismatchError(
                f"shard_spec names {name!r}, which the checkpoint in {hf_dir} does not hold (it holds e.g. "
                f"{list(state)[:5]}); drop it from the spec or fix the name. Nothing was written."
            )
        if tuple(state[name].shape) != spec.full_shape:
            raise TensorMismatchError(
                f"shard_spec gives {name!r} full_shape {list(spec.full_shape)}, but the checkpoint in {hf_dir} "
                f"holds it with shape {list(state[name].shape)}; build the spec from the saved shapes. "
                f"Nothing was written."
            )


def _rank_view(tensor: torch.Tensor, spec, rank: int) -> torch.Tensor:
    if spec is None or spec.shard_dim is None:
        return tensor
    start = sum(spec.shard_sizes[:rank])
    return tensor.narrow(spec.shard_dim, start, spec.shard_sizes[rank])


def _mapped_safetensors(store, path: str) -> Dict[str, torch.Tensor]:
    header = shard_header(store, path)
    mapped = store.map_private(path) if header.tensors else None  # private: never writes the file
    if mapped is None:  # a store whose files cannot be mapped: read them
        from shardkit.hf.shard_io import read_shard

        return read_shard(store, path, list(header.tensors),
                          lambda n, e: torch.empty(e.shape, dtype=from_safetensors_name(e.dtype)))
    out = {}
    for name, entry in header.tensors.items():
        dtype = from_safetensors_name(entry.dtype)
        count = math.prod(entry.shape)
        if count == 0:
            out[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=entry.begin).reshape(entry.shape)
    return out

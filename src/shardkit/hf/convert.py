"""Convert between a shardkit distributed checkpoint and a Hugging Face one, tensor by tensor.

Distributed -> HF: the model tensors are chosen from ``metadata.json`` alone
(``export_plan.select_model_names``: no optimizer state, no ``__rank_state__``,
a lone ``model.`` subtree stripped), planned into shards, and written through
the one HF writer (``export_write``), each whole tensor read (through one
``open_checkpoint``: the manifest once, each data file opened once), cast
when ``dtype`` is given, written, dropped: memory stays around the largest
tensor, never the model. The index is written last, under the writer lock.
``shardkit convert --to hf`` (``offline.export_hf``) is the same export into
a new directory, from any checkpoint kind.

HF -> distributed: the HF shards are memory-mapped (file-backed pages the
kernel can drop, not copies) and handed to ``save_distributed`` as one rank
with every tensor replicated; it loads on any world size. To get a sharded
layout, load it and save again with a ``shard_spec``. Not here: tokenizers,
optimizer state.

Example::

    distributed_to_hf("ckpt/step-100", "export/step-100", max_shard_size=2**30, dtype=torch.bfloat16)
    hf_to_distributed("export/step-100", "ckpt/imported")
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Union

import torch

from shardkit.checkpoint.loading.read_path import open_checkpoint
from shardkit.checkpoint.loading.validate import data_problems
from shardkit.dtypes import from_safetensors_name
from shardkit.layout import whole_box
from shardkit.errors import IncompleteCheckpointError, MetadataError, TensorMismatchError
from shardkit.hf.bin_io import read_bin_shard
from shardkit.hf.saving.export_plan import out_dtype, plan_export, select_model_names
from shardkit.hf.saving.export_write import export_index, remove_previous, write_export
from shardkit.hf.index import load_shard_index, shard_size_bytes
from shardkit.hf.saving.save_checks import check_export_dtype
from shardkit.hf.shard_io import shard_header
from shardkit.hf.untrusted import hostile_input, non_regular_problems
from shardkit.storage import LazyTensor
from shardkit.storage import storage_for
from shardkit.storage.plain_values import encode_objects

__all__ = ["distributed_to_hf", "hf_to_distributed", "load_distributed_flat", "read_config_file"]


def distributed_to_hf(
    dist_dir: str,
    hf_dir: str,
    *,
    safetensors: bool = True,
    max_shard_size: Union[int, str] = 2**31,
    metadata: Optional[Dict] = None,
    dtype: Optional[torch.dtype] = None,
    prefix: Optional[str] = None,
    config: Optional[str] = None,
) -> None:
    """Write the full (unsharded) model tensors of the distributed checkpoint ``dist_dir`` as an HF checkpoint.

    Which tensors: ``prefix`` as ``select_model_names`` reads it (None: the
    model's, without optimizer state or ``__rank_state__``, a lone ``model.``
    stripped; ``""``: every tensor as named). ``dtype`` casts floating
    tensors (e.g. ``torch.bfloat16``). ``config``: a ``config.json`` (path or
    URL) to write beside the weights. Non-tensor leaves of the chosen
    subtree go to ``metadata["shardkit_objects"]`` in the index. With
    ``safetensors=False`` each ``.bin`` shard is built in memory (a shard,
    not the model). An HF checkpoint already in ``hf_dir`` is replaced.

    Every byte of the source is hashed against its checksums before an HF
    checkpoint already in ``hf_dir`` is replaced: a damaged source raises
    ``IncompleteCheckpointError`` (a missing file ``MissingShardError``) and
    leaves ``hf_dir`` as it was. That is one extra read of the source.
    ``max_shard_size``: bytes, or a string such as ``"5GB"`` (as for
    ``save_checkpoint``). A bad size, a ``dtype`` that is not floating, or
    ``metadata`` the index cannot hold and read back (a numpy scalar, NaN)
    raises before ``hf_dir`` is touched.
    """
    max_shard_bytes = shard_size_bytes(max_shard_size)
    check_export_dtype(dtype, safetensors)
    store, root = storage_for(dist_dir)
    not_files = non_regular_problems(store, root)
    if not_files:
        raise MetadataError(f"{dist_dir}: {not_files[0]}")
    with hostile_input(dist_dir, fix="the distributed checkpoint is damaged; convert an earlier one"):
        source = open_checkpoint(dist_dir)
    with source:  # one manifest read, each data file opened once for the whole conversion
        _refuse_damaged(source, dist_dir, hf_dir)
        names = select_model_names(source.manifest.tensors, prefix)
        lazy = {new: _lazy(source, old, dtype) for old, new in names.items()}
        plan = plan_export([(n, t.nbytes) for n, t in lazy.items()], 1, max_shard_bytes, safetensors)
        meta = _converted_meta(source.manifest.objects, source.manifest.tensors, names, metadata)
        index_data = export_index(plan.weight_map, {n: t.nbytes for n, t in lazy.items()}, meta, None, safetensors)
        configs = {"config.json": read_config_file(config)} if config else {}
        out_store, out_root = storage_for(hf_dir)
        with out_store.writer_lock(out_root, holder="shardkit.hf.distributed_to_hf"):
            remove_previous(out_store, out_root)
            write_export(out_store, out_root, [(f.name, f.names) for f in plan.files], lazy.__getitem__, index_data,
                         configs, safetensors)


def _lazy(source, name: str, dtype: Optional[torch.dtype]) -> LazyTensor:
    shape = tuple(source.manifest.tensors[name].spec.full_shape)
    saved = source.dtype(name)
    wanted = out_dtype(saved, dtype)

    def load() -> torch.Tensor:
        whole = source.region(name, [0] * len(shape), list(shape))
        return whole if wanted == saved else whole.to(wanted)

    return LazyTensor(wanted, shape, load)


def _converted_meta(objects: dict, all_names, names: dict, metadata: Optional[Dict]) -> Optional[dict]:
    """``metadata`` plus the saved plain values beside the exported tensors, as ``shardkit_objects``.

    The values follow the tensors: under the prefix they were stripped of
    (stripped too), and not under a top-level name whose tensors were left out (``optim``, ``step``).
    """
    if metadata is not None and not isinstance(metadata, dict):
        raise MetadataError(f"metadata must be a dict (or None), got {type(metadata).__name__}: {str(metadata)[:80]}")
    old, new = next(iter(names.items()), ("", ""))
    stripped = old[: len(old) - len(new)]
    left_out = {n.split(".", 1)[0] for n in all_names} - {n.split(".", 1)[0] for n in names}
    kept = {n[len(stripped):]: v for n, v in objects.items()
            if n.startswith(stripped) and len(n) > len(stripped) and n.split(".", 1)[0] not in left_out}
    return {**(metadata or {}), "shardkit_objects": encode_objects(kept)} if kept else metadata


def read_config_file(config: str) -> bytes:
    """The bytes of a (small, JSON) ``config.json`` at a path or URL, to write beside exported weights.

    Refused with ``MetadataError``: a file over ``knobs.MAX_INDEX_BYTES`` or one that is not a JSON object.
    """
    import json

    from shardkit import knobs

    store, path = storage_for(config)
    data = store.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES)
    try:
        ok = isinstance(json.loads(data), dict)
    except ValueError:
        ok = False
    if not ok:
        raise MetadataError(f"{config} is not a JSON object; a config.json is one (e.g. {{\"model_type\": ...}})")
    return data


def _refuse_damaged(source, dist_dir: str, hf_dir: str) -> None:
    """Hash every data file of the open ``source`` against its record before ``hf_dir`` is touched."""
    files = source.files()
    for name, record in source.records.items():
        problems = data_problems(files.get(name)[0], name, record)
        if problems:
            raise IncompleteCheckpointError(f"{dist_dir} is damaged: {problems[0]}. Nothing in {hf_dir} was "
                                            f"touched; convert an earlier checkpoint.")


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
    from shardkit.checkpoint.saving.distributed_save import save_distributed
    from shardkit.checkpoint.format.spec import as_spec_dict, check_world
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

"""Streamed writers: reshard a distributed checkpoint, export any checkpoint as HF or as distributed.

Each tensor (or each rank's slice of it) is a :class:`~shardkit.storage.LazyTensor`
whose ``load`` reads it from the source (``load_region`` of exactly the box
a new rank holds, or :meth:`CheckpointSource.read`) when the file writer
reaches it, and is dropped once written: peak memory is about the largest
chunk moved, never the checkpoint. Files are the formats' own
(``write_safetensors``; ``metadata.json`` and rank manifests from
``checkpoint.manifest``; the HF index from ``hf.index``), so every reader
(``load_distributed``, ``transformers``) reads the result. Output goes
through :func:`~shardkit.offline.publish.publish_directory`.

Example::

    reshard_checkpoint("ckpt/step-100", "ckpt/ws3", world_size=3)
    export_hf("ckpt/step-100", "hf/step-100", prefix="model.", dtype=torch.bfloat16)
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Optional

import torch

from shardkit.errors import TensorMismatchError
from shardkit.offline.publish import publish_directory
from shardkit.storage import LazyTensor, storage_for, write_safetensors

__all__ = ["reshard_checkpoint", "export_hf", "export_distributed", "select_names"]

log = logging.getLogger("shardkit.offline")
Progress = Optional[Callable[[int], None]]   # called with the bytes just written


def _tick(progress: Progress, lazy: LazyTensor) -> LazyTensor:
    if progress is None:
        return lazy

    def load():
        t = lazy.load()
        progress(lazy.nbytes)
        return t

    return LazyTensor(lazy.dtype, lazy.shape, load)


def _write_distributed(tmp: str, world_size: int, entries: dict, objects: dict, structure, user_metadata,
                       progress: Progress) -> None:
    """``entries``: name -> (dtype, new TensorShardSpec, box_for_rank(rank) -> (offsets, sizes), read(offsets, sizes))."""
    from shardkit.checkpoint.manifest import (
        METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, write_json)
    from shardkit.checkpoint.plan import plan_save
    from shardkit.dtypes import itemsize_bytes, to_safetensors_name

    storage, root = storage_for(tmp)
    nbytes = {n: itemsize_bytes(d) * _numel(s.full_shape) for n, (d, s, _, _) in entries.items()}
    specs = {n: s for n, (_, s, _, _) in entries.items() if s.shard_dim is not None}
    records, owner_of = {}, {}
    for rank in range(world_size):
        plan = plan_save(nbytes, specs, rank, world_size)
        owner_of = plan.owner_of
        named = []
        for name in plan.write_names:
            dtype, _, box_for, read = entries[name]
            offsets, sizes = box_for(rank)
            named.append((name, _tick(progress, LazyTensor(dtype, tuple(sizes),
                                                            lambda r=read, o=offsets, s=sizes: r(o, s)))))
        file_name = data_file_name(rank)
        log.info("writing %s (%d tensors)", file_name, len(named))
        records[file_name] = write_safetensors(
            storage, storage.join(root, file_name), named,
            {"format": "pt", "shardkit.rank": str(rank), "shardkit.num_ranks": str(world_size)})
    saved = {n: SavedTensor(s, to_safetensors_name(d), owner_of.get(n)) for n, (d, s, _, _) in entries.items()}
    manifest = Manifest(1, world_size, saved, records, objects, structure, user_metadata)
    write_json(storage, storage.join(root, METADATA_FILE), manifest_to_json(manifest))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_distributed(tmp: str) -> list:
    from shardkit.checkpoint import validate_distributed

    return validate_distributed(tmp).problems


def reshard_checkpoint(src: str, dst: str, world_size: int, *, progress: Progress = None) -> None:
    """Write the distributed checkpoint ``src`` as saved by ``world_size`` ranks, into the new directory ``dst``.

    Sharded tensors are re-split along the same dimension
    (``compute_shard_sizes``), replicated ones stay replicated, plain values
    and user metadata are kept. Reads each new slice with ``load_region``
    (only the overlapping bytes), writes it, drops it. ``dst`` must not
    exist; it appears complete and validated, or not at all.

    >>> reshard_checkpoint("ckpt/step-100", "ckpt/step-100-ws3", world_size=3)
    """
    from shardkit.checkpoint import load_region, read_metadata
    from shardkit.checkpoint.plan import wanted_box
    from shardkit.checkpoint.spec import TensorShardSpec
    from shardkit.hf.convert import _saved_dtype
    from shardkit.layout import compute_shard_sizes

    if not isinstance(world_size, int) or world_size < 1:
        raise TensorMismatchError(f"--world-size must be an integer >= 1, got {world_size!r}")
    m = read_metadata(src)
    from shardkit.sources import open_source

    open_source(src, "distributed").close()  # refuses an incomplete checkpoint before any work
    entries = {}
    for name, saved in m.tensors.items():
        spec = saved.spec
        if spec.shard_dim is not None:
            spec = TensorShardSpec(spec.full_shape, spec.shard_dim,
                                   tuple(compute_shard_sizes(spec.full_shape[spec.shard_dim], world_size)))
        dtype = _saved_dtype(src, name, saved)
        box_for = (lambda r, s=saved: tuple(wanted_box(s, m.num_ranks, r, world_size)))
        read = (lambda o, s, n=name: load_region(src, n, o, s))
        entries[name] = (dtype, spec, box_for, read)
    log.info("resharding %s (%d ranks) -> %s (%d ranks), %d tensors", src, m.num_ranks, dst, world_size, len(entries))
    publish_directory(dst, lambda tmp: _write_distributed(tmp, world_size, entries, m.objects, m.structure,
                                                          m.user_metadata, progress), _check_distributed)


def select_names(names, prefix: Optional[str]) -> dict[str, str]:
    """``source name -> exported name``: only names under ``prefix`` (stripped); all names when None.

    ``prefix=None`` with both ``model.*`` and other top-level names (a
    training checkpoint: model plus optimizer) picks ``"model."``.
    """
    names = list(names)
    if prefix is None:
        tops = {n.split(".", 1)[0] for n in names}
        if "model" in tops and len(tops) > 1:
            prefix = "model."
            log.info("exporting the model subtree only (prefix 'model.'); pass --prefix '' to export everything")
    if not prefix:
        return {n: n for n in names}
    chosen = {n: n[len(prefix):] for n in names if n.startswith(prefix) and len(n) > len(prefix)}
    if not chosen:
        tops = sorted({n.split(".", 1)[0] + "." for n in names})
        raise TensorMismatchError(f"no tensor name starts with {prefix!r}; the checkpoint's top-level "
                                  f"prefixes are {tops[:10]}")
    return chosen


def export_hf(src: str, dst: str, *, kind: Optional[str] = None, prefix: Optional[str] = None,
              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 10**9,
              config: Optional[str] = None, progress: Progress = None) -> None:
    """Export the model in any checkpoint ``src`` (distributed, HF, DCP) as a Hugging Face checkpoint ``dst``.

    Takes the subtree under ``prefix`` and strips it (see :func:`select_names`:
    a training checkpoint's optimizer state is left out), casts floating
    tensors to ``dtype`` when given, writes ``model-0000i-of-0000n.safetensors``
    shards of at most ``max_shard_bytes`` and the index, and copies
    ``config`` (or a ``config.json`` found in ``src``). Plain values are not exported.

    >>> export_hf("dcp_ckpt", "hf_out", prefix="model.", dtype=torch.bfloat16)
    """
    from shardkit.hf.index import index_file_name, plan_shards, save_shard_index, shard_file_name
    from shardkit.sources import open_source

    with open_source(src, kind) as source:
        infos = source.tensors()
        names = select_names(infos, prefix)
        lazy = {}
        for old, new in names.items():
            info = infos[old]
            out_dtype = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
            load = (lambda n=old, d=out_dtype: source.read(n).to(d))
            lazy[new] = _tick(progress, LazyTensor(out_dtype, info.shape, load))
        plan = plan_shards([(n, t.nbytes) for n, t in lazy.items()], max_shard_bytes)
        weight_map = {n: shard_file_name(i + 1, len(plan), True) for i, ns in enumerate(plan) for n in ns}
        config = config or _config_beside(src)

        def build(tmp: str) -> None:
            storage, root = storage_for(tmp)
            for i, ns in enumerate(plan):
                path = storage.join(root, shard_file_name(i + 1, len(plan), True))
                log.info("writing %s (%d tensors)", path, len(ns))
                write_safetensors(storage, path, [(n, lazy[n]) for n in ns], {"format": "pt"}, checksum=False)
            meta = {"total_size": sum(t.nbytes for t in lazy.values())}
            save_shard_index({"metadata": meta, "weight_map": weight_map}, tmp, index_file_name(True))
            if config:
                shutil.copyfile(config, os.path.join(tmp, "config.json"))

        publish_directory(dst, build, _check_hf)


def _config_beside(src: str) -> Optional[str]:
    path = os.path.join(src, "config.json")
    return path if os.path.isfile(path) else None


def _check_hf(tmp: str) -> list:
    from shardkit.hf.directory import checkpoint_problems

    return checkpoint_problems(tmp)


def export_distributed(src: str, dst: str, *, kind: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                       progress: Progress = None) -> None:
    """Import any checkpoint ``src`` (HF, DCP, distributed) as a shardkit distributed checkpoint ``dst``.

    Saved as one rank with every tensor replicated (it loads on any world
    size; reshard it for a sharded layout). Plain values the source keeps
    (DCP's ints, floats, strings) go to ``objects``. Tensor by tensor.

    >>> export_distributed("dcp_ckpt", "ckpt/imported")
    """
    from shardkit.checkpoint.spec import TensorShardSpec
    from shardkit.layout import whole_box
    from shardkit.sources import open_source

    with open_source(src, kind) as source:
        entries = {}
        for name, info in source.tensors().items():
            out_dtype = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
            spec = TensorShardSpec(tuple(info.shape), None, ())
            entries[name] = (out_dtype, spec, lambda r, s=info.shape: tuple(whole_box(s)),
                             lambda o, s, n=name, d=out_dtype: source.read(n).to(d))
        objects = source.objects()
        publish_directory(dst, lambda tmp: _write_distributed(tmp, 1, entries, objects, None, {}, progress),
                          _check_distributed)

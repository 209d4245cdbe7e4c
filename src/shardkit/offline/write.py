"""Streamed writers: reshard a distributed checkpoint, export any checkpoint as HF or as distributed.

Each tensor (or each rank's slice of it) is a :class:`~shardkit.storage.LazyTensor`
served by a :class:`~shardkit.offline.write_overlap.ReadAhead`: the source fills
it in place (:meth:`CheckpointSource.read_into` of exactly the box a new
rank holds; the source's files opened once) while the file writer writes the
one before, in two reused buffers: peak memory is about two of the largest
chunks moved, never the checkpoint. Files are the formats' own: a
distributed checkpoint is written by the engine ``save`` uses (format
version 3: ``plan.spec_chunk_plan``, ``chunked_save.write_data_file`` per
rank, ``chunked_save.commit`` last); HF output by ``hf.saving.export_write``. Every
reader (``load``, ``load_distributed``, ``transformers``) reads the result. Output goes
through :func:`~shardkit.offline.publish.publish_directory`.

Example::

    reshard_checkpoint("ckpt/step-100", "ckpt/ws3", world_size=3)
    export_hf("ckpt/step-100", "hf/step-100", prefix="model.", dtype=torch.bfloat16)
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from shardkit.dtypes import itemsize_bytes
from shardkit.errors import TensorMismatchError
from shardkit.hf.saving.export_plan import TRAINING_STATE_NAMES, out_dtype, select_model_names
from shardkit.offline.publish import publish_directory
from shardkit.offline.write_overlap import ReadAhead
from shardkit.storage import LazyTensor, storage_for

__all__ = ["reshard_checkpoint", "export_hf", "export_distributed", "select_names", "TRAINING_STATE_NAMES"]

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


def _writer_order(names, dtype_of) -> list:
    """The order ``write_safetensors`` writes ``names`` in (widest dtype first, then by name)."""
    return sorted(names, key=lambda n: (-itemsize_bytes(dtype_of(n)), n))


def _write_distributed(tmp: str, world_size: int, entries: dict, fill, objects: dict, structure, user_metadata,
                       progress: Progress) -> None:
    """Write a format-2 checkpoint of ``world_size`` ranks into ``tmp`` through the save's engine
    (``plan.spec_chunk_plan``, then ``chunked_save.write_data_file`` per rank and ``commit`` last).

    ``entries``: name -> (dtype, TensorShardSpec of the new layout); ``fill(name, offsets, out)``
    reads that box of ``name`` into ``out``. The next chunk is read while the current one is written
    (:class:`~shardkit.offline.write_overlap.ReadAhead`)."""
    from shardkit.checkpoint.saving.chunked_save import Prepared, commit, write_data_file
    from shardkit.checkpoint.format.manifest import data_file_name
    from shardkit.checkpoint.planning.plan import spec_chunk_plan
    from shardkit.dtypes import to_safetensors_name

    storage, root = storage_for(tmp)
    tensors = {n: (s.full_shape, to_safetensors_name(d)) for n, (d, s) in entries.items()}
    specs = {n: s for n, (_, s) in entries.items() if s.shard_dim is not None}
    plan = spec_chunk_plan(tensors, specs, world_size, lambda n: itemsize_bytes(_dtype_named(n)))
    boxes = [{} for _ in range(world_size)]    # rank -> name -> the box it writes
    for name, chunked in plan.tensors.items():
        for box, rank in chunked.box_to_writer.items():
            boxes[rank][name] = box
    items = []
    for rank in range(world_size):
        for name in _writer_order(plan.writes[rank], lambda n: entries[n][0]):
            box = boxes[rank][name]
            items.append(((rank, name), entries[name][0], box.sizes,
                          lambda out, n=name, o=box.offsets: fill(n, o, out)))
    written = []
    with ReadAhead(items) as ahead:
        for rank in range(world_size):
            named = [(name, _tick(progress, ahead.lazy((rank, name)))) for name in plan.writes[rank]]
            log.info("writing %s (%d tensors)", data_file_name(rank), len(named))
            written.append(write_data_file(storage, root, rank, world_size, named))
    prep = Prepared(0, world_size, lambda: plan, {}, objects, structure, user_metadata,
                    {n: s.shard_dim for n, s in specs.items()})
    commit(storage, root, prep, written)


def _dtype_named(name: str) -> torch.dtype:
    from shardkit.dtypes import NAME_TO_DTYPE

    return NAME_TO_DTYPE[name]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_distributed(tmp: str) -> list:
    """Problems with the directory just written: everything but re-hashing the data, whose block
    checksums ``write_safetensors`` took from the bytes it handed to the files (and compared with
    the source's) while writing them."""
    from shardkit.checkpoint.loading.validate import validate_distributed

    return validate_distributed(tmp, hash_bytes=False).problems


def reshard_checkpoint(src: str, dst: str, world_size: int, *, progress: Progress = None) -> None:
    """Write the distributed checkpoint ``src`` as saved by ``world_size`` ranks, into the new directory ``dst``.

    Sharded tensors are re-split along the same dimension
    (``compute_shard_sizes``; a DTensor/FSDP2 tensor saved in chunks along
    one dimension along that one; chunks along several dimensions are
    written whole, with a log line), replicated ones stay replicated, plain values
    and user metadata are kept. Each new slice is read (only the overlapping
    bytes, every checksum block verified) into one of two reused buffers
    while the previous one is written, then dropped: memory is about two of
    the largest slices, not the checkpoint. ``dst`` must not exist; it
    appears complete and checked, or not at all.

    >>> reshard_checkpoint("ckpt/step-100", "ckpt/step-100-ws3", world_size=3)
    """
    from shardkit.checkpoint.planning.plan import chunk_split_dim
    from shardkit.checkpoint.format.spec import TensorShardSpec
    from shardkit.layout import compute_shard_sizes
    from shardkit.sources import open_source

    if not isinstance(world_size, int) or world_size < 1:
        raise TensorMismatchError(f"--world-size must be an integer >= 1, got {world_size!r}")
    with open_source(src, "distributed") as source:  # refuses an incomplete checkpoint before any work
        m = source.manifest
        infos = source.tensors()
        entries = {}
        for name, saved in m.tensors.items():
            spec = saved.spec
            dim = spec.shard_dim if saved.chunks is None else chunk_split_dim(saved)
            if dim is not None:
                spec = TensorShardSpec(spec.full_shape, dim, tuple(compute_shard_sizes(spec.full_shape[dim], world_size)))
            elif saved.chunks is not None and len(saved.chunks) > 1:
                log.warning("%s is split along several dimensions (%d chunks); it is written whole (replicated)",
                            name, len(saved.chunks))
            entries[name] = (infos[name].dtype, spec)   # an uneven saved split is made even
        log.info("resharding %s (%d ranks) -> %s (%d ranks), %d tensors", src, m.num_ranks, dst, world_size,
                 len(entries))
        publish_directory(dst, lambda tmp: _write_distributed(
            tmp, world_size, entries, lambda n, o, out: source.read_into(n, out, o), m.objects, m.structure,
            m.user_metadata, progress), 
                          _check_distributed)


def select_names(names, prefix: Optional[str]) -> dict[str, str]:
    """``source name -> exported name``; :func:`shardkit.hf.saving.export_plan.select_model_names` (kept under this name).

    >>> sorted(select_names(["model.w", "optim.w_m"], None).items())
    [('model.w', 'w')]
    """
    return select_model_names(names, prefix)


def export_hf(src: str, dst: str, *, kind: Optional[str] = None, prefix: Optional[str] = None,
              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 * 10**9,
              config: Optional[str] = None, progress: Progress = None) -> None:
    """Export the model in any checkpoint ``src`` (distributed, HF, DCP) as a Hugging Face checkpoint ``dst``.

    The model tensors only, by default: ``prefix`` as
    :func:`~shardkit.hf.saving.export_plan.select_model_names` reads it (None: no
    optimizer state, no ``__rank_state__``, a lone ``model.`` subtree
    stripped; ``""``: every tensor as named). Casts floating tensors to
    ``dtype`` when given, writes ``model-0000i-of-0000n.safetensors`` shards
    of at most ``max_shard_bytes`` through the one HF writer
    (:mod:`shardkit.hf.saving.export_write`, as ``save_checkpoint`` and
    ``distributed_to_hf`` do) and the index last, and copies ``config`` (or
    a ``config.json`` found in ``src``). Each tensor is read while the one
    before is written (:class:`~shardkit.offline.write_overlap.ReadAhead`).
    Plain values are not exported. ``dst`` must not exist; it appears
    complete and checked, or not at all.

    >>> export_hf("dcp_ckpt", "hf_out", prefix="model.", dtype=torch.bfloat16)
    """
    from shardkit.hf.convert import read_config_file
    from shardkit.hf.saving.export_plan import plan_export
    from shardkit.hf.saving.export_write import export_index, write_export, write_order
    from shardkit.hf.saving.save_checks import check_export_dtype
    from shardkit.sources import open_source

    check_export_dtype(dtype, True)
    with open_source(src, kind) as source:
        infos = source.tensors()
        names = select_model_names(infos, prefix)
        old_of = {new: old for old, new in names.items()}
        dtypes = {new: out_dtype(infos[old].dtype, dtype) for old, new in names.items()}
        shapes = {new: tuple(infos[old].shape) for old, new in names.items()}
        nbytes = {n: itemsize_bytes(dtypes[n]) * _numel(shapes[n]) for n in dtypes}
        plan = plan_export(list(nbytes.items()), 1, max_shard_bytes, True)
        files = [(f.name, write_order(f.names, dtypes.__getitem__, shapes.__getitem__)) for f in plan.files]
        items = [(n, dtypes[n], shapes[n], _filler(source, old_of[n], infos[old_of[n]].dtype))
                 for _, ns in files for n in ns]
        index_data = export_index(plan.weight_map, nbytes, None, None, True)
        config = config or _config_beside(src)
        configs = {"config.json": read_config_file(config)} if config else {}

        def build(tmp: str) -> None:
            storage, root = storage_for(tmp)
            with ReadAhead(items) as ahead:
                write_export(storage, root, files, lambda n: _tick(progress, ahead.lazy(n)), index_data, configs,
                             True)

        publish_directory(dst, build, _check_hf)


def _filler(source, name: str, saved_dtype: torch.dtype):
    """``fill(out)`` for tensor ``name``: straight into ``out`` when no cast is needed, else read and cast."""
    def fill(out: torch.Tensor) -> None:
        if out.dtype == saved_dtype:
            source.read_into(name, out)
        else:
            out.copy_(source.read(name))
    return fill


def _config_beside(src: str) -> Optional[str]:
    storage, root = storage_for(src)
    path = storage.join(root, "config.json")
    return path if storage.exists(path) and not storage.isdir(path) else None


def _check_hf(tmp: str) -> list:
    from shardkit.hf.directory import checkpoint_problems

    return checkpoint_problems(tmp)


def export_distributed(src: str, dst: str, *, kind: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                       progress: Progress = None) -> None:
    """Import any checkpoint ``src`` (HF, DCP, distributed) as a shardkit distributed checkpoint ``dst``.

    Saved as one rank with every tensor replicated (it loads on any world
    size; reshard it for a sharded layout). Plain values the source keeps
    (DCP's ints, floats, strings, and lists, tuples and dicts of them such as
    AdamW's ``betas``) go to ``objects`` as shardkit's save writes them (see
    :func:`_leaf_objects`); a distributed source's nesting and user metadata
    are kept. Tensor by tensor.

    >>> export_distributed("dcp_ckpt", "ckpt/imported")
    """
    from shardkit.checkpoint.format.spec import TensorShardSpec
    from shardkit.sources import open_source

    with open_source(src, kind) as source:
        entries, fills = {}, {}
        for name, info in source.tensors().items():
            spec = TensorShardSpec(tuple(info.shape), None, ())
            entries[name] = (out_dtype(info.dtype, dtype), spec)
            fills[name] = _filler(source, name, info.dtype)
        objects, structure = _leaf_objects(src, list(entries), source.objects(), source.structure())
        user_metadata = source.user_metadata()
        publish_directory(dst, lambda tmp: _write_distributed(tmp, 1, entries, lambda n, o, out: fills[n](out),
                                                              objects, structure, user_metadata, progress),
                          _check_distributed)


def _leaf_objects(src: str, tensor_names: list, objects: dict, structure) -> tuple:
    """``(objects, structure)`` for the manifest: plain leaves only, as shardkit's own save writes them.

    A source without a structure (DCP, HF) may hold a list, tuple or dict as
    one value (DCP keeps AdamW's ``optim.param_groups.0.betas`` whole); the
    manifest holds only plain leaves, so the names and values are flattened
    by :func:`~shardkit.checkpoint.format.nested.flatten` (``...betas.0``,
    ``...betas.1``) and its structure keeps each source name as one
    top-level key: a load gives back the source's names, each value as it
    was (a tuple as a tuple). A source with a structure (shardkit's own) is
    already in that form and is kept as is. Does not write anything.

    >>> _leaf_objects("ck", ["w"], {"b": (0.9, 0.99)}, None)[0]
    {'b.0': 0.9, 'b.1': 0.99}
    """
    from shardkit.checkpoint.format.nested import flatten

    if structure is not None or not objects:
        return objects, structure
    placeholder = torch.empty(0)  # the tensors' leaves in the structure; their bytes are written from the source
    try:
        flat = flatten({**dict.fromkeys(tensor_names, placeholder), **objects})
    except TypeError as e:  # a value JSON cannot hold (inf, nan): the source is fine, the format cannot take it
        raise TensorMismatchError(f"{src}: {e}; shardkit keeps plain values as JSON in metadata.json, so this "
                                  f"checkpoint cannot be converted as it is (nothing was written)") from e
    return flat.objects, flat.structure

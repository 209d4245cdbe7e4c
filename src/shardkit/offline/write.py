"""Streamed writers: reshard a distributed checkpoint, export any checkpoint as HF or as distributed.

Each tensor (or each rank's slice of it) is a :class:`~shardkit.storage.LazyTensor`
served by a :class:`~shardkit.offline.readahead.ReadAhead`: the source fills
it in place (:meth:`CheckpointSource.read_into` of exactly the box a new
rank holds; the source's files opened once) while the file writer writes the
one before, in two reused buffers: peak memory is about two of the largest
chunks moved, never the checkpoint. Files are the formats' own
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
from typing import Callable, Optional

import torch

from shardkit.dtypes import itemsize_bytes
from shardkit.errors import TensorMismatchError
from shardkit.offline.publish import publish_directory
from shardkit.offline.readahead import ReadAhead
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


def _writer_order(names, dtype_of) -> list:
    """The order ``write_safetensors`` writes ``names`` in (widest dtype first, then by name)."""
    return sorted(names, key=lambda n: (-itemsize_bytes(dtype_of(n)), n))


def _write_distributed(tmp: str, world_size: int, entries: dict, fill, objects: dict, structure, user_metadata,
                       progress: Progress) -> None:
    """``entries``: name -> (dtype, new TensorShardSpec, box_for_rank(rank) -> (offsets, sizes));
    ``fill(name, offsets, out)`` reads that box of ``name`` into ``out``. The next slice is read
    while the current one is written (:class:`~shardkit.offline.readahead.ReadAhead`)."""
    from shardkit.checkpoint.manifest import (
        METADATA_FILE, Manifest, SavedTensor, data_file_name, manifest_to_json, write_json)
    from shardkit.checkpoint.plan import plan_save
    from shardkit.dtypes import to_safetensors_name

    storage, root = storage_for(tmp)
    nbytes = {n: itemsize_bytes(d) * _numel(s.full_shape) for n, (d, s, _) in entries.items()}
    specs = {n: s for n, (_, s, _) in entries.items() if s.shard_dim is not None}
    plans = [plan_save(nbytes, specs, rank, world_size) for rank in range(world_size)]
    items = []
    for rank, plan in enumerate(plans):
        for name in _writer_order(plan.write_names, lambda n: entries[n][0]):
            dtype, _, box_for = entries[name]
            offsets, sizes = box_for(rank)
            items.append(((rank, name), dtype, tuple(sizes), lambda out, n=name, o=offsets: fill(n, o, out)))
    records = {}
    with ReadAhead(items) as ahead:
        for rank, plan in enumerate(plans):
            named = [(name, _tick(progress, ahead.lazy((rank, name)))) for name in plan.write_names]
            file_name = data_file_name(rank)
            log.info("writing %s (%d tensors)", file_name, len(named))
            records[file_name] = write_safetensors(
                storage, storage.join(root, file_name), named,
                {"format": "pt", "shardkit.rank": str(rank), "shardkit.num_ranks": str(world_size)})
    owner_of = plans[-1].owner_of if plans else {}
    saved = {n: SavedTensor(s, to_safetensors_name(d), owner_of.get(n)) for n, (d, s, _) in entries.items()}
    manifest = Manifest(1, world_size, saved, records, objects, structure, user_metadata)
    write_json(storage, storage.join(root, METADATA_FILE), manifest_to_json(manifest))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_distributed(tmp: str) -> list:
    """Problems with the directory just written: everything but re-hashing the data, whose block
    checksums ``write_safetensors`` took from the bytes it handed to the files (and compared with
    the source's) while writing them."""
    from shardkit.checkpoint import validate_distributed

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
    from shardkit.checkpoint.spec import TensorShardSpec
    from shardkit.layout import compute_shard_sizes, shard_box, whole_box
    from shardkit.sources import open_source

    if not isinstance(world_size, int) or world_size < 1:
        raise TensorMismatchError(f"--world-size must be an integer >= 1, got {world_size!r}")
    with open_source(src, "distributed") as source:  # refuses an incomplete checkpoint before any work
        m = source.manifest
        infos = source.tensors()
        entries = {}
        for name, saved in m.tensors.items():
            spec = saved.spec
            dim = spec.shard_dim if spec.shard_dim is not None else _chunk_split_dim(saved)
            if dim is not None:
                spec = TensorShardSpec(spec.full_shape, dim, tuple(compute_shard_sizes(spec.full_shape[dim], world_size)))
            elif saved.chunks is not None and len(saved.chunks) > 1:
                log.warning("%s is split along several dimensions (%d chunks); it is written whole (replicated)",
                            name, len(saved.chunks))
            # the boxes of the spec written (an uneven saved split is made even, whatever the world size)
            box_for = (lambda r, sp=spec: tuple(whole_box(sp.full_shape) if sp.shard_dim is None else
                                                shard_box(sp.full_shape, sp.shard_dim, sp.shard_sizes, r)))
            entries[name] = (infos[name].dtype, spec, box_for)
        log.info("resharding %s (%d ranks) -> %s (%d ranks), %d tensors", src, m.num_ranks, dst, world_size,
                 len(entries))
        publish_directory(dst, lambda tmp: _write_distributed(
            tmp, world_size, entries, lambda n, o, out: source.read_into(n, out, o), m.objects, m.structure,
            m.user_metadata, progress), 
                          _check_distributed)


def _chunk_split_dim(saved) -> Optional[int]:
    """The one dimension the chunks of a chunked (format 2) tensor split, or None (one chunk, or several dims)."""
    if not saved.chunks or len(saved.chunks) < 2:
        return None
    full = saved.spec.full_shape
    dims = {d for c in saved.chunks for d, (size, whole) in enumerate(zip(c.box.sizes, full)) if size != whole}
    return dims.pop() if len(dims) == 1 else None


#: Top-level names of a training checkpoint's state beside its model (``prefix=None`` leaves them out).
TRAINING_STATE_NAMES = frozenset({
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "lr_scheduler", "scheduler",
    "schedulers", "scaler", "grad_scaler", "step", "epoch", "rng", "rng_state", "dataloader", "trainer",
    "extra_state", "train_state",
})


def select_names(names, prefix: Optional[str]) -> dict[str, str]:
    """``source name -> exported name``: only names in the subtree ``prefix`` (stripped); all names when None.

    ``prefix`` is a subtree: ``"model"`` means ``"model."``. ``prefix=None``
    picks ``"model."`` only when every other top-level name is known
    training state (:data:`TRAINING_STATE_NAMES`: optimizer, scheduler,
    step, ...), saying what it leaves out; otherwise everything is exported
    as named (a Hugging Face model's ``model.*`` beside ``lm_head.weight``
    keeps both).

    >>> sorted(select_names(["model.w", "optim.w_m"], None).items())
    [('model.w', 'w')]
    >>> sorted(select_names(["model.w", "lm_head.weight"], None))
    ['lm_head.weight', 'model.w']
    """
    names = list(names)
    if prefix is None:
        tops = {n.split(".", 1)[0] for n in names}
        if "model" in tops and len(tops) > 1 and tops - {"model"} <= TRAINING_STATE_NAMES:
            prefix = "model."
            log.warning("exporting the model subtree only (prefix 'model.', stripped), leaving out %s; "
                        "pass --prefix '' to export everything", ", ".join(sorted(tops - {"model"})))
    if not prefix:
        return {n: n for n in names}
    prefix = prefix if prefix.endswith(".") else prefix + "."
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
        out_dtypes = {new: _out_dtype(infos[old].dtype, dtype) for old, new in names.items()}
        sizes = [(n, itemsize_bytes(out_dtypes[n]) * _numel(infos[old].shape)) for old, n in names.items()]
        plan = plan_shards(sizes, max_shard_bytes)
        weight_map = {n: shard_file_name(i + 1, len(plan), True) for i, ns in enumerate(plan) for n in ns}
        old_of = {new: old for old, new in names.items()}
        items = [(n, out_dtypes[n], tuple(infos[old_of[n]].shape), _filler(source, old_of[n], infos[old_of[n]].dtype))
                 for ns in plan for n in _writer_order(ns, out_dtypes.__getitem__)]
        config = config or _config_beside(src)

        def build(tmp: str) -> None:
            storage, root = storage_for(tmp)
            with ReadAhead(items) as ahead:
                for i, ns in enumerate(plan):
                    path = storage.join(root, shard_file_name(i + 1, len(plan), True))
                    log.info("writing %s (%d tensors)", path, len(ns))
                    write_safetensors(storage, path, [(n, _tick(progress, ahead.lazy(n))) for n in ns],
                                      {"format": "pt"}, checksum=False)
            meta = {"total_size": sum(b for _, b in sizes)}
            save_shard_index({"metadata": meta, "weight_map": weight_map}, tmp, index_file_name(True))
            if config:
                _copy_config(config, storage, storage.join(root, "config.json"))

        publish_directory(dst, build, _check_hf)


def _out_dtype(saved: torch.dtype, wanted: Optional[torch.dtype]) -> torch.dtype:
    return wanted if wanted is not None and saved.is_floating_point else saved


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


def _copy_config(config: str, storage, path: str) -> None:
    """Copy the (small, JSON) ``config`` file, local or a URL, to ``path`` of ``storage``."""
    from shardkit import knobs

    source, source_path = storage_for(config)
    data = source.read_bytes(source_path, max_bytes=knobs.MAX_INDEX_BYTES)
    with storage.atomic_writer(path) as f:
        f.write(data)


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
    from shardkit.checkpoint.spec import TensorShardSpec
    from shardkit.layout import whole_box
    from shardkit.sources import open_source

    with open_source(src, kind) as source:
        entries, fills = {}, {}
        for name, info in source.tensors().items():
            spec = TensorShardSpec(tuple(info.shape), None, ())
            entries[name] = (_out_dtype(info.dtype, dtype), spec, lambda r, s=info.shape: tuple(whole_box(s)))
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
    by :func:`~shardkit.checkpoint.nested.flatten` (``...betas.0``,
    ``...betas.1``) and its structure keeps each source name as one
    top-level key: a load gives back the source's names, each value as it
    was (a tuple as a tuple). A source with a structure (shardkit's own) is
    already in that form and is kept as is. Does not write anything.

    >>> _leaf_objects("ck", ["w"], {"b": (0.9, 0.99)}, None)[0]
    {'b.0': 0.9, 'b.1': 0.99}
    """
    from shardkit.checkpoint.nested import flatten

    if structure is not None or not objects:
        return objects, structure
    placeholder = torch.empty(0)  # the tensors' leaves in the structure; their bytes are written from the source
    try:
        flat = flatten({**dict.fromkeys(tensor_names, placeholder), **objects})
    except TypeError as e:  # a value JSON cannot hold (inf, nan): the source is fine, the format cannot take it
        raise TensorMismatchError(f"{src}: {e}; shardkit keeps plain values as JSON in metadata.json, so this "
                                  f"checkpoint cannot be converted as it is (nothing was written)") from e
    return flat.objects, flat.structure

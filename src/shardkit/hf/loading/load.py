"""Load a Hugging Face checkpoint (sharded or single file, safetensors or ``.bin``).

Module mode fills an ``nn.Module``: each tensor is read from the file straight
into the parameter's memory when it is a CPU tensor of the same dtype and
shape (no intermediate copy), then tied parameters are tied again; with
``assign=True`` the parameters become tensors over maps of the files
(zero-copy, see :func:`load_checkpoint`). Dict mode returns ``{name: tensor}``,
by default over copy-on-write maps of local safetensors files (zero-copy). ``keys=`` opens only the shards that hold those
keys. ``.bin`` files go through ``torch.load(weights_only=True)`` only. This
module does not save, and does not choose among checkpoints in a directory.

Example::

    load_checkpoint("out/model", model)                           # module mode
    sd = load_checkpoint("out/model", None, keys={"lm_head.weight"})  # dict mode
"""

from __future__ import annotations

from typing import Dict, Optional, Set, Union

import torch
from torch import Tensor
from torch.nn import Module

from shardkit import knobs
from shardkit.errors import MetadataError, MissingShardError, TensorMismatchError
from shardkit.hf.bin_io import read_bin_shard
from shardkit.hf.index import (
    ShardIndex,
    alias_to_source,
    check_index,
    load_shard_index,
    sharing_of,
)
from shardkit.hf.loading.load_checks import check_shape, check_shards, refuse_missing
from shardkit.hf.loading.shard_reads import read_files
from shardkit.hf.shard_io import shard_header
from shardkit.hf.sharing import check_ties, create_sharing_metadata, retie_parameters
from shardkit.hf.untrusted import hostile_input, non_regular_problems
from shardkit.storage import storage_for
from shardkit.storage.fast_io.destinations import shared_destinations

__all__ = ["load_checkpoint", "load_sharded_checkpoint"]


def load_checkpoint(
    model_dir: str,
    module: Optional[Module] = None,
    device: str = "cpu",
    strict: bool = True,
    assign: bool = False,
    keys: Optional[Set[str]] = None,
    *,
    mmap: Union[bool, str] = "auto",
) -> Union[None, Dict[str, Tensor]]:
    """Load the checkpoint in ``model_dir``, whatever its Hugging Face layout.

    Finds, in this order, ``model.safetensors.index.json``, ``model.safetensors``,
    ``pytorch_model.bin.index.json``, ``pytorch_model.bin``, and a shardkit
    distributed checkpoint (``metadata.json``, consolidated). With a module,
    loads into it and returns None; with ``module=None`` returns the tensors
    (only ``keys`` if given). Raises ``MissingShardError`` if none is there.
    A module holding DTensors (FSDP2, tensor parallel) is filled in place by
    :func:`shardkit.checkpoint.load`, each rank reading only its shards
    (any format it reads: Hugging Face, shardkit, DCP).

    **Zero-copy by default** (``mmap="auto"``, the default, follows
    ``knobs.HF_MMAP_LOADS``, True): local safetensors files in dict mode or
    with ``assign=True`` come back as tensors over copy-on-write
    (``MAP_PRIVATE``) maps of the files instead of being read, as
    ``safetensors.torch.load_file`` and ``from_pretrained`` do. What that means:

    - the call returns before any tensor byte is read; pages come from the
      page cache (or disk) when first touched, and are shared with the page
      cache -- and with every other process that maps the same file -- until
      a tensor is written to;
    - read-ahead: one background thread maps the loaded tensors' pages (only
      theirs, with ``keys``) ahead of first use and asks for large page-cache
      folios, so touching them costs fewer faults and a cold file is read
      from disk while the caller starts on its first tensors
      (``knobs.MAP_PREFETCH = False`` turns that off; see ``storage.fast_io.map_prefetch``);
    - copy-on-write: writing to a loaded tensor copies that page privately;
      it never reaches the file;
    - one open file descriptor per mapped file, while any of its tensors
      lives: a dict load of a 400-shard checkpoint holds 400 (past the
      process's limit, ``ulimit -n``, the load raises ``CheckpointIOError``
      saying so; ``mmap=False`` keeps none);
    - the pages are the file's: under memory pressure the kernel drops them
      (no swap needed) and reads them again when touched; they count in the
      process's RSS as shared file pages while mapped;
    - truncation caveat: a file truncated or rewritten *in place* while its
      tensors live makes touching them fail with SIGBUS (the process dies).
      shardkit's own saves (and ``save_pretrained``) replace files whole by
      rename, so an overwrite by them is safe: the tensors keep the old file;
    - no content check: Hugging Face safetensors files carry no checksums, so
      no load of them (mapped or copied) can see a flipped byte; the sizes
      and header are checked as always, and ``validate_checkpoint`` checks
      that every file is there, whole, with the tensors the index names. A
      shardkit distributed checkpoint is checksummed: ``validate_distributed``
      re-hashes every byte, which is the content check for its mapped loads.

    Copies are made otherwise: ``.bin`` files, remote (fsspec) files, tensors
    whose offset in the file is not aligned to their element size, and a
    module load with ``assign=False`` (the default), which copies into the
    module's own parameters. Opt out with ``mmap=False`` (or
    ``knobs.HF_MMAP_LOADS = False`` for every ``"auto"`` call): every tensor
    is then read into fresh memory. ``mmap=True`` maps where it can whatever
    the knob.

    **When a module load fails.** What can be checked without reading tensor
    bytes is checked before any tensor of the module changes: that the
    checkpoint has the module's tensors (``strict``), that every file the load
    reads is there and each safetensors header is whole and holds the tensors
    placed in it in the module's shapes, and that ties recorded in the index
    join names of one shape and dtype. A failure there leaves the module as it
    was. A failure while the bytes themselves are read (an I/O error, a file
    rewritten under the load) can come after some tensors were read in place
    (``assign=False`` from safetensors files): the module is then partly
    loaded -- some tensors new, the rest as before -- and must be loaded again
    before use. With ``assign=True``, and from a distributed checkpoint (whose
    checksums are checked as it is read, ``knobs.VERIFY_ON_LOAD``), everything
    is read before the module changes, so a failure leaves it as it was.

    Example::

        sd = load_checkpoint("out/model", None)               # zero-copy dict
        sd = load_checkpoint("out/model", None, mmap=False)   # private copies
    """
    from shardkit.hf.directory import get_checkpoint_metadata

    if isinstance(module, Module) and _holds_dtensors(module):
        return _load_sharded_module(model_dir, module, strict, assign, keys)
    meta = get_checkpoint_metadata(model_dir)
    if meta is None:
        raise MissingShardError(
            f"{model_dir} holds no Hugging Face checkpoint: looked for model.safetensors.index.json, "
            f"model.safetensors, pytorch_model.bin.index.json and pytorch_model.bin. Check the path, "
            f"or find a complete checkpoint with find_latest_checkpoint()."
        )
    if meta.distributed:
        store, root = storage_for(model_dir)
        not_files = non_regular_problems(store, root)
        if not_files:
            raise MetadataError(f"{model_dir}: {not_files[0]}")
        # The distributed reader is hardened on its own side; anything it still
        # lets through as a builtin error is typed here.
        with hostile_input(model_dir, fix="the distributed checkpoint is damaged; load an earlier one"):
            return _load_distributed(model_dir, module, device, strict, assign, keys)
    if meta.is_index:
        index = load_shard_index(model_dir, meta.file_name)
    else:
        index = _single_file_index(model_dir, meta.file_name, meta.safetensors)
    result = load_sharded_checkpoint(
        model_dir, index, module, device=device, safetensors=meta.safetensors, strict=strict,
        assign=assign, keys=keys, mmap=mmap,
    )
    return result if module is None else None


def _holds_dtensors(module: Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in [*module.parameters(), *module.buffers()])


def _load_sharded_module(model_dir, module, strict, assign, keys) -> None:
    """An FSDP2 / tensor-parallel module (DTensor parameters): each rank fills only its own shards, in
    place, through ``checkpoint.load`` (any format it reads; tied weights stored once fill both names).
    ``strict`` as for any module: names of the module the checkpoint lacks are an error; names it has
    and the module lacks never are. Loading does not cast (``checkpoint.load(..., cast=True)`` does)."""
    from shardkit.checkpoint.api import load

    if assign or keys is not None:
        raise TensorMismatchError(
            f"load_checkpoint({model_dir!r}, module) with {'assign=True' if assign else 'keys='}: a module "
            f"with DTensor (FSDP2 / tensor-parallel) parameters is filled in place, shard by shard; load it "
            f"without them, or load a dict with module=None")
    load(module.state_dict(), model_dir, strict=False, allow_partial=not strict)


def _load_distributed(model_dir, module, device, strict, assign, keys):
    """A shardkit distributed checkpoint, consolidated: whole tensors by flat name.

    Into a module, ties are handled as from an HF index (:func:`load_sharded_checkpoint`): names the
    module ties to a saved name count as provided, each tie is read once and tied again after the
    load. Every tensor is read, and its shape checked against the manifest, before the module changes.
    """
    from shardkit.checkpoint.loading.distributed_load import read_metadata
    from shardkit.hf.convert import load_distributed_flat

    if module is None:
        return {n: t.to(device) for n, t in load_distributed_flat(model_dir, keys).items()}
    own = module.state_dict(keep_vars=True)
    own_ties = create_sharing_metadata(module)  # before the load: assign=True breaks them
    saved = read_metadata(model_dir).tensors  # names the module lacks: never an error
    refuse_missing(model_dir, own, own_ties, set(saved), strict)
    own_to_stored = _own_to_stored(own, saved, {})
    for name in own_to_stored:
        check_shape(name, saved[name].spec.full_shape, own[name].shape)
    tensors = {n: t.to(device) for n, t in load_distributed_flat(model_dir, list(own_to_stored)).items()}
    try:
        module.load_state_dict(tensors, strict=False, assign=assign)
    except RuntimeError as e:
        raise TensorMismatchError(
            f"the distributed checkpoint in {model_dir} does not match the module ({e}); load the "
            f"right checkpoint, or pass strict=False"
        ) from e
    retie_parameters(module, _loaded_first(own_ties, set(tensors)))
    return None


def _single_file_index(model_dir: str, file_name: str, safetensors: bool) -> ShardIndex:
    store, root = storage_for(model_dir)
    path = store.join(root, file_name)
    if safetensors:
        names = list(shard_header(store, path).tensors)
    else:
        names = list(read_bin_shard(store, path))
    return {"metadata": {}, "weight_map": dict.fromkeys(names, file_name)}


def load_sharded_checkpoint(
    model_dir: str,
    shard_index: ShardIndex,
    module: Optional[Module] = None,
    device: str = "cpu",
    safetensors: bool = False,
    strict: bool = True,
    assign: bool = False,
    debug: bool = False,
    keys: Optional[Set[str]] = None,
    *,
    mmap: Union[bool, str] = "auto",
) -> Union[Set[str], Dict[str, Tensor]]:
    """Load the tensors ``shard_index`` describes from ``model_dir``.

    Module mode returns the set of the module's keys the checkpoint did not
    provide; with ``strict=True`` any such key raises ``TensorMismatchError``
    before a shard is read. Keys the index has and the module lacks are not
    read and never an error, as in forgather: each shard of a model loads
    from the one index of the whole model. Names the module ties together
    (``lm_head.weight`` to the embedding) count as provided when one of them
    is, and are tied to what was loaded afterwards, ``assign=True`` included.
    A tie is read once, from its first name in the module's order (the
    embedding), even where the files hold differing copies of both names,
    as ``transformers``' ``tie_weights`` leaves it. Tensors whose memory
    overlaps otherwise are copied in one after the other, as
    ``load_state_dict`` does. An index tie between names of different shapes
    or dtypes in the module, a shard that is missing or whose header is
    malformed, and a tensor of another shape are refused before the module
    changes (what a failure later leaves: see :func:`load_checkpoint`). Dict
    mode returns ``{name: tensor}`` on ``device``, tied names sharing one
    tensor. ``mmap``: see :func:`load_checkpoint`.
    """
    if module is not None and not isinstance(module, Module):
        raise TensorMismatchError(
            f"module must be an nn.Module to load into, or None to get a dict; got {type(module).__name__}"
        )
    check_index(shard_index, "", source="shard_index", suffixes=(".safetensors", ".bin"))
    mmap = _wants_map(mmap)
    weight_map = shard_index["weight_map"]
    aliases = {a: s for a, s in alias_to_source(sharing_of(shard_index)).items() if s in weight_map}
    if module is None:
        return _load_dict(model_dir, weight_map, aliases, device, safetensors, keys, debug, mmap)
    return _load_module(model_dir, shard_index, aliases, module, device, safetensors, strict, assign, debug, mmap)


def _wants_map(mmap) -> bool:
    if mmap == "auto":
        return bool(knobs.HF_MMAP_LOADS)
    if isinstance(mmap, bool):
        return mmap
    raise TypeError(f"mmap must be True, False or \"auto\", got {mmap!r}")


def _load_dict(model_dir, weight_map, aliases, device, safetensors, keys, debug, mmap) -> Dict[str, Tensor]:
    wanted = list(weight_map) + list(aliases) if keys is None else list(keys)
    unknown = [k for k in wanted if k not in weight_map and k not in aliases]
    if unknown:
        raise TensorMismatchError(
            f"keys {sorted(unknown)[:10]} are not in the checkpoint in {model_dir} "
            f"({len(weight_map)} tensors); check the names (e.g. {list(weight_map)[:3]})"
        )
    sources = list(dict.fromkeys(aliases.get(k, k) for k in wanted))
    loaded = read_files(model_dir, weight_map, sources, safetensors, debug, mmap=mmap)
    if torch.device(device).type != "cpu":
        loaded = {n: t.to(device) for n, t in loaded.items()}
    return {k: loaded[aliases.get(k, k)] for k in wanted}


def _load_module(model_dir, shard_index, aliases, module, device, safetensors, strict, assign, debug, mmap) -> Set[str]:
    weight_map = shard_index["weight_map"]
    own = module.state_dict(keep_vars=True)
    own_ties = create_sharing_metadata(module)  # before the load: assign=True breaks them
    missing = refuse_missing(model_dir, own, own_ties, set(weight_map) | set(aliases), strict)
    check_ties(module, sharing_of(shard_index), source=f"the index in {model_dir}")
    own_to_stored = _own_to_stored(own, weight_map, aliases)
    targets = {} if assign else _in_place_targets(own, own_to_stored)
    if targets:  # reads in place: refuse what would stop the load part-way before the first one
        check_shards(model_dir, weight_map, own, own_to_stored)
    with torch.no_grad():
        loaded = read_files(model_dir, weight_map, list(own_to_stored.values()), safetensors, debug, targets, mmap)
        _install(module, own, {name: loaded[stored] for name, stored in own_to_stored.items()}, device, assign)
    _retie_from_index(module, model_dir, sharing_of(shard_index))
    retie_parameters(module, _loaded_first(own_ties, set(own_to_stored)))
    return missing


def _retie_from_index(module, model_dir, groups) -> None:
    """Tie what the index says is shared; a group this module cannot tie means a corrupt or foreign index."""
    try:
        retie_parameters(module, groups)
    except (TypeError, KeyError, AttributeError) as e:  # e.g. a group tying a buffer to a parameter
        raise TensorMismatchError(
            f"the index in {model_dir} ties {str(groups)[:200]}, which this module cannot tie ({e}); "
            f"the index is corrupt or for a different model"
        ) from e


def _own_to_stored(own, weight_map, aliases) -> Dict[str, str]:
    """``{module name: name stored in the files}`` for each tensor of the module to read.

    A name stored under a tie (``param_sharing``) whose stored name the module
    lacks -- a pipeline stage holding ``lm_head.weight`` while another holds
    the embedding -- reads the stored tensor; when the module has the stored
    name too, retying covers it. Each stored tensor is read once, and so is
    each tensor of the module: of names the module ties together (the same
    view of one memory), only the first in the module's order is read, and
    the tie gives the others its values, as ``transformers``' ``tie_weights``
    does, even where the files hold differing copies.
    """
    out: Dict[str, str] = {}
    for name in own:
        stored = name if name in weight_map else aliases.get(name)
        if stored is not None and (stored == name or stored not in own) and stored not in out.values():
            out[name] = stored
    tied, _ = shared_destinations({name: own[name] for name in out})
    return {name: stored for name, stored in out.items() if name not in tied}


def _in_place_targets(own, own_to_stored: Dict[str, str]) -> Dict[str, Tensor]:
    """``{stored name: module tensor}`` to read straight into, in parallel.

    Tied names were read once already (:func:`_own_to_stored`); tensors whose
    memory overlaps another's otherwise are read apart and copied in one after
    the other by ``load_state_dict``, as parallel reads into one byte would race.
    """
    _, overlapping = shared_destinations({name: own[name] for name in own_to_stored})
    return {stored: own[name] for name, stored in own_to_stored.items() if name not in overlapping}


def _loaded_first(own_ties, loaded: Set[str]):
    """The module's own tie groups that hold a loaded name, loaded names first: retying them points
    every name at what was loaded (``assign=True`` replaced only the names the files hold), as
    ``transformers`` does with ``tie_weights``."""
    return [
        [n for n in group if n in loaded] + [n for n in group if n not in loaded]
        for group in own_ties
        if any(n in loaded for n in group)
    ]


def _install(module: Module, own: Dict[str, Tensor], loaded: Dict[str, Tensor], device, assign: bool) -> None:
    """Put tensors that were not read in place into the module."""
    rest = {n: t for n, t in loaded.items() if assign or not _read_into(t, own[n])}
    if not rest:
        return
    for name, t in rest.items():
        check_shape(name, t.shape, own[name].shape)
    if assign:
        rest = {n: t.to(device) for n, t in rest.items()}
    module.load_state_dict(rest, strict=False, assign=assign)


def _read_into(loaded: Tensor, target: Tensor) -> bool:
    """True when ``loaded`` is ``target``'s own memory, read in place (address alone: empty tensors all have 0)."""
    return loaded.data_ptr() == target.data_ptr() and tuple(loaded.shape) == tuple(target.shape)

"""``checkpoint.load``'s engine: fill a state in place from any opened checkpoint (shardkit, DCP, Hugging Face).

The steps, every check before the first read:

1. names: :func:`~shardkit.checkpoint.planning.load_names.plan_names` maps each state
   leaf to the checkpoint name it reads (``prefix``, ``rename``, ``exclude``,
   tied-weight aliases, ``strict``, ``allow_partial``);
2. boxes: each tensor leaf's box on this rank (a DTensor's ``local_box``, a
   plain tensor's whole shape), its global shape and dtype checked against
   the checkpoint (another floating dtype only with ``cast=True``);
3. reads: the source's ``read_boxes`` (one reader per format,
   ``shardkit.sources``) through the fill engine (``checkpoint/loading/fill.py``):
   straight into the local tensors where they are contiguous CPU tensors of
   the saved dtype; else, on the CPU from a source that allows it
   (``slab_reads``: Hugging Face), a slab of rows at a time through one
   reused scratch buffer, then ``copy_`` (otherwise into temporaries of
   the box's size, then ``copy_``).
   A rank reads only its boxes' bytes and never allocates a tensor it does
   not hold;
4. plain leaves are replaced from the checkpoint's values.

It never writes to the checkpoint, never adds leaves to the state, and
issues no collective.

Example::

    with open_source("hf_dir", verify=None) as src:
        load_from_source(state, src, rank, world_size, LoadOptions(cast=True))
"""

from __future__ import annotations

import warnings
from typing import Mapping

import torch

from shardkit.checkpoint.planning.dtensor_layout import local_box, outside_mesh
from shardkit.checkpoint.loading.fill import fill
from shardkit.checkpoint.loading.load_into import replace_plain, state_leaves
from shardkit.checkpoint.planning.load_names import LoadOptions, plan_names
from shardkit.checkpoint.format.rank_state import check_reserved, is_rank_state_name, rank_state_targets, warn_world_changed
from shardkit.errors import TensorMismatchError
from shardkit.layout import Box
from shardkit.sources.base import CheckpointSource, leaf_values
from shardkit.storage.fast_io.destinations import shared_destinations

__all__ = ["load_from_source"]


def load_from_source(state_dict, source: CheckpointSource, rank: int, world_size: int, options: LoadOptions,
                     rank_state=None) -> None:
    """Fill ``state_dict`` (nested) in place from ``source``; see the module docstring."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict (possibly nested), got {type(state_dict).__name__}")
    tensors, others = state_leaves(state_dict)
    check_reserved([*tensors, *others])
    shapes = {n: s for n, s in source.shapes().items() if not is_rank_state_name(n)}
    objects = {n: v for n, v in leaf_values(source.objects()).items() if not is_rank_state_name(n)}
    plan = plan_names(list(tensors), sorted(others), shapes, objects, options, source.aliases())
    wanted = _wanted(plan.tensors, tensors, shapes, source, options.cast)
    extra, plain = _rank_state_wanted(source, rank_state, rank, world_size, options.cast)
    passes = _passes({**wanted, **extra})
    for one in passes:
        source.check_boxes({c: box for c, (box, _) in one.items()})
    for one in passes:
        _fill_pass(source, one)
    replace_plain(state_dict, "", {s: objects[c] for s, c in plan.objects.items()})
    if plain:
        replace_plain(rank_state, "", {leaf: source.manifest.objects[saved] for saved, leaf in plain.items()})


def _wanted(state_to_saved: Mapping[str, str], tensors, shapes, source, cast: bool) -> dict[str, tuple]:
    """``{state name: (checkpoint name, box, local tensor)}`` of the leaves this rank fills, checked."""
    out = {}
    for name, saved in state_to_saved.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shapes[saved]):
            raise TensorMismatchError(
                f"tensor {name!r} has global shape {list(t.shape)}, the checkpoint saved {list(shapes[saved])}"
                f"{'' if saved == name else f' (as {saved!r})'}; build the model with the saved shapes")
        if outside_mesh(t):  # a rank outside the DTensor's mesh holds nothing of it to fill
            continue
        box, local = local_box(name, t)
        if local.device.type == "meta":
            raise TensorMismatchError(f"state_dict's tensor {name!r} is on the meta device, which holds no data "
                                      f"to fill; allocate it first (e.g. module.to_empty(device='cpu'))")
        _check_dtype(name, local.dtype, source.dtype_of(saved), cast)
        out[name] = (saved, box, local.detach())  # detach: parameters that require grad, same memory
    return out


def _check_dtype(name: str, dtype: torch.dtype, saved: torch.dtype, cast: bool) -> None:
    if dtype == saved:
        return
    if not cast:
        raise TensorMismatchError(
            f"tensor {name!r} is {dtype} in state_dict, but the checkpoint saved it as {saved}; loading never "
            f"casts silently. Pass cast=True to convert it on load (between floating dtypes), or give "
            f"state_dict a {saved} tensor")
    if not (dtype.is_floating_point and saved.is_floating_point):
        raise TensorMismatchError(
            f"tensor {name!r} is {dtype} in state_dict and {saved} in the checkpoint; cast=True converts only "
            f"between floating dtypes (bf16 weights into fp32 parameters). Give state_dict a {saved} tensor")


def _rank_state_wanted(source, rank_state, rank: int, world_size: int, cast: bool) -> tuple[dict, dict]:
    """The rank-state tensors to fill (as :func:`_wanted` gives them) and plain leaves ``{saved: leaf}``."""
    if rank_state is None:
        return {}, {}
    manifest = getattr(source, "manifest", None)
    if manifest is None:
        warnings.warn(f"{source.path} is a {source.kind} checkpoint, which keeps no per-rank state; rank_state "
                      f"is left as it is (re-seed each rank, e.g. seed + rank)", UserWarning, stacklevel=4)
        return {}, {}
    if manifest.num_ranks != world_size:
        warn_world_changed(manifest.num_ranks, world_size)
        return {}, {}
    targets, boxes, plain = rank_state_targets(rank_state, rank)
    absent = sorted(n for n in [*targets, *plain] if n not in manifest.tensors and n not in manifest.objects)
    if absent:
        raise TensorMismatchError(f"rank_state has {len(absent)} leaves the checkpoint lacks: {', '.join(absent[:8])}; "
                                  f"pass the rank_state that was saved, or none")
    out = {}
    for name, t in targets.items():
        _check_dtype(name, t.dtype, source.dtype_of(name), cast)
        out[name] = (name, boxes[name], t.detach())
    return out, plain


def _passes(wanted: Mapping[str, tuple]) -> list[dict[str, tuple[Box, torch.Tensor]]]:
    """``wanted`` as reads keyed by checkpoint name: each pass names a stored tensor at most once (a tied
    weight stored once fills two state leaves in two passes); leaves over the very same memory as an
    earlier one are filled by it, not read again. Each pass maps ``checkpoint name -> (box, target)``."""
    tied, _ = shared_destinations({name: local for name, (_, _, local) in wanted.items()})
    passes: list[dict[str, tuple[Box, torch.Tensor]]] = []
    for name, (saved, box, local) in wanted.items():
        if name in tied:
            continue
        free = next((p for p in passes if saved not in p), None)
        if free is None:
            free = {}
            passes.append(free)
        free[saved] = (box, local)
    return passes


def _fill_pass(source: CheckpointSource, reads: Mapping[str, tuple[Box, torch.Tensor]]) -> None:
    targets = {name: local for name, (_, local) in reads.items()}
    _, overlapping = shared_destinations(targets)
    dtypes = {name: source.dtype_of(name) for name in reads}
    def read_rows(name: str, first: int, count: int, out: torch.Tensor) -> None:
        box = reads[name][0]
        source.read_boxes({name: Box((box.offsets[0] + first, *box.offsets[1:]), (count, *box.sizes[1:]))},
                          {name: out})

    fill(targets, dtypes,
         lambda names, outputs: source.read_boxes({n: reads[n][0] for n in names}, outputs),
         apart=overlapping, read_rows=read_rows if source.slab_reads else None, prefault=True)

"""Loading into tensors that already exist: ``load_distributed(..., out=state)``.

Like ``torch.distributed.checkpoint.load(state_dict)`` and
``module.load_state_dict``: each tensor leaf of ``out`` (named by its dotted
path, as :func:`~shardkit.checkpoint.format.nested.flatten` names it) receives this
rank's slice of the saved tensor of that name, in place, so resuming training
needs no second copy of the state. Contiguous CPU tensors are read into
directly (``execute.run_loads`` with ``outputs``); GPU and non-contiguous ones
through temporary CPU tensors, at most ``knobs.LOAD_STAGE_BYTES`` of them at
a time, then ``copy_`` (the fill engine every in-place load shares,
``checkpoint/loading/fill.py``). Plain leaves that the checkpoint also holds are
replaced in their container (a tuple is rebuilt, since it cannot change).

Every name, shape, dtype and file header is checked before any tensor byte
is read, so a bad ``out`` raises :class:`TensorMismatchError` and leaves it
untouched. Leaves over the same memory (tied parameters, both in a
``state_dict()``) are read once, from the first of them in ``out``'s order;
leaves whose memory overlaps otherwise are filled one after the other, never
by two reads at once. It never casts, never moves a tensor to another device, and never
adds leaves to ``out`` (a fresh optimizer's empty ``state`` has nothing to
fill: load that part without ``out``, or step once first). A checkpoint found corrupt *while* reading
(:class:`ChecksumError` with ``verify=True``) can leave ``out`` partly filled.

Example::

    state = {"model": model.state_dict(), "step": 0}
    with open_checkpoint("/ckpt/step-7") as ck:
        load_into(state, ck, rank=1, world_size=3, keys=None)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from shardkit.checkpoint.loading.execute import check_chunks, check_plans, run_loads, saved_dtype, scratch_elems_of
from shardkit.checkpoint.loading.fill import fill
from shardkit.checkpoint.format.manifest import Manifest
from shardkit.checkpoint.format.nested import join_name, select_names
from shardkit.checkpoint.planning.plan import plan_load, wanted_box
from shardkit.checkpoint.loading.read_path import OpenCheckpoint
from shardkit.errors import TensorMismatchError
from shardkit.layout import Box
from shardkit.storage.fast_io.destinations import shared_destinations

__all__ = ["load_into", "state_leaves", "replace_plain"]


def load_into(out: Mapping, ck: OpenCheckpoint, rank: int, world_size: int, *,
              keys, boxes: Mapping[str, Box] | None = None) -> Mapping:
    """Fill ``out``'s tensors in place with this rank's slices and replace its plain leaves; returns ``out``.

    Reads only the tensors ``out`` names (and ``keys`` selects, when given). ``boxes`` (by name)
    overrides the box of the global tensor a leaf receives (a DTensor's local box, say).
    It does not add the checkpoint's other leaves to ``out``; plain leaves of
    ``out`` that the checkpoint lacks stay as they are.

    Reads through ``ck`` (its manifest, its open files, its ``verify``).

    >>> load_into(state, ck, 0, 2, keys=None) is state
    True
    """
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a dict (possibly nested), like the state that was saved; got "
                        f"{type(out).__name__}")
    m, files = ck.manifest, ck.files()
    tensors, others = state_leaves(out)
    names = _chosen([*tensors, *others], [*m.tensors, *m.objects], keys)
    targets = {n: tensors[n].detach() for n in tensors if n in names}  # detach: params that require grad
    want = {n: _check_target(n, t, m, rank, world_size, (boxes or {}).get(n)) for n, t in targets.items()}
    _check_plain(others & names, m, rank, world_size)
    dtypes = {n: saved_dtype(files, n, m.tensors[n]) for n in want}
    for n, t in targets.items():
        _check_dtype(n, t, dtypes[n])
    check_chunks(files, m.tensors, want, dtypes)  # claimed shapes vs the files, before planning
    plans = plan_load(m.tensors, want, scratch_elems_of(dtypes))
    check_plans(files, plans, dtypes.__getitem__)
    tied, overlapping = shared_destinations(targets)
    by_name = {p.name: p for p in plans if p.name not in tied}  # a tied leaf is filled by its first name
    fill({n: targets[n] for n in by_name}, dtypes,
         lambda names, outputs: run_loads(files, [by_name[n] for n in names], dtypes.__getitem__, outputs),
         apart=overlapping)
    replace_plain(out, "", {n: m.objects[n] for n in names if n in m.objects})
    return out


def state_leaves(state: Mapping) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensor leaves of ``state`` by dotted name (in the state's order), and the names of its other leaves."""
    tensors: dict[str, torch.Tensor] = {}
    others: set[str] = set()
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, torch.Tensor):
            if path in tensors:
                raise TensorMismatchError(f"two tensors of out have the same name {path!r} (a key containing '.' "
                                          f"collides with a nested path); rename one of them")
            tensors[path] = node
        elif isinstance(node, Mapping):  # pushed in reverse: popped, and so named, in the state's order
            stack.extend(reversed([(join_name(path, k), child) for k, child in node.items()]))
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed([(join_name(path, i), child) for i, child in enumerate(node)]))
        else:
            others.add(path)
    return tensors, others


def _chosen(out_names: list[str], saved_names: list[str], keys) -> set[str]:
    # A key the checkpoint lacks raises as it does without out; then keys filter out's names too.
    select_names(saved_names, keys)
    return set(select_names(list(dict.fromkeys([*out_names, *saved_names])), keys))


def _check_target(name: str, tensor: torch.Tensor, m: Manifest, rank: int, world_size: int,
                  box: Box | None = None) -> Box:
    saved = m.tensors.get(name)
    if saved is None:
        found = "holds a plain value (not a tensor) under that name" if name in m.objects else "has no such tensor"
        raise TensorMismatchError(f"out has a tensor {name!r}, but the checkpoint {found}; it holds: "
                                  f"{_sample(m.tensors)}. Remove it from out, or load part of out with keys=")
    if tensor.device.type == "meta":
        raise TensorMismatchError(f"out's tensor {name!r} is on the meta device, which holds no data to fill; "
                                  f"allocate it first (e.g. module.to_empty(device='cpu'))")
    box = wanted_box(saved, m.num_ranks, rank, world_size) if box is None else box
    if tuple(tensor.shape) != tuple(box.sizes):
        raise TensorMismatchError(
            f"out's tensor {name!r} has shape {list(tensor.shape)}, but rank {rank} of {world_size} loads "
            f"shape {list(box.sizes)} of it ({_layout(saved.spec)}); give out a tensor of that shape")
    return box


def _check_plain(names: set[str], m: Manifest, rank: int, world_size: int) -> None:
    clashes = sorted(n for n in names if n in m.tensors)
    if clashes:
        name = clashes[0]
        shape = list(wanted_box(m.tensors[name], m.num_ranks, rank, world_size).sizes)
        raise TensorMismatchError(f"out's leaf {name!r} is not a tensor, but the checkpoint holds a tensor "
                                  f"there; put a tensor of shape {shape} in out to fill it, or leave "
                                  f"{name!r} out with keys=")


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise TensorMismatchError(f"out's tensor {name!r} is {tensor.dtype}, but the checkpoint saved it as "
                                  f"{dtype}; loading never casts silently. Give out a {dtype} tensor (and "
                                  f"cast it after loading if you need {tensor.dtype})")


def _layout(spec) -> str:
    if spec.shard_dim is None:
        return f"the saved tensor is {list(spec.full_shape)}, replicated"
    return f"the saved tensor is {list(spec.full_shape)}, sharded on dimension {spec.shard_dim}"


def _sample(names) -> str:
    names = sorted(names)
    return (", ".join(names[:8]) + (", ..." if len(names) > 8 else "")) or "no tensors"


def replace_plain(node: Any, path: str, values: dict[str, Any]) -> Any:
    """``node`` with each non-tensor leaf named in ``values`` replaced: dicts, lists in place; tuples rebuilt."""
    if isinstance(node, torch.Tensor):
        return node
    if isinstance(node, Mapping):
        for key, child in list(node.items()):
            new = replace_plain(child, join_name(path, key), values)
            if new is not child:
                node[key] = new
        return node
    if isinstance(node, (list, tuple)):
        items = [replace_plain(child, join_name(path, i), values) for i, child in enumerate(node)]
        if isinstance(node, list):
            node[:] = items
            return node
        changed = any(a is not b for a, b in zip(items, node))
        return node if not changed else tuple(items) if type(node) is tuple else type(node)(*items)
    return values[path] if path in values else node

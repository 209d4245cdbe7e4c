"""Nested state (dicts, lists, tuples) to flat dotted names and back, without pickle.

A leaf's name is its path joined with ``.`` (list items by index:
``optim.state.0.exp_avg``). Tensor leaves go to the shard files; plain
leaves (``int``, ``float`` including NaN and infinities, ``bool``, ``str``,
``None``, ``bytes``, ``bytearray``, numpy scalars) go to ``metadata.json`` as
JSON (``storage.plain_values`` says which and how). The *structure* is a small
JSON tree that records container types and the exact keys (``str`` or
``int``, so optimizer state keyed by ints comes back with int keys). Anything
else is refused with a ``TypeError`` naming its path: nothing is ever pickled.

Example::

    flat = flatten({"model": {"w": w}, "step": 3})
    flat.tensors      # {"model.w": w}
    flat.objects      # {"step": 3}
    unflatten(flat.structure, {"model.w": w, "step": 3}) == {"model": {"w": w}, "step": 3}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.storage.json_io import short_repr
from shardkit.storage.plain_values import checked_value

__all__ = ["Flat", "flatten", "unflatten", "select_names", "join_name", "check_structure"]

_TENSOR, _OBJECT = "T", "O"


@dataclass
class Flat:
    """A flattened state: tensor leaves, plain leaves (as saved: a ``bytearray`` is a copy) and the structure."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    structure: Any


def flatten(state: Mapping) -> Flat:
    """Split ``state`` (a mapping, possibly nested) into named tensor and plain leaves."""
    if not isinstance(state, Mapping):
        raise TypeError(f"the state must be a dict (possibly nested), got {type(state).__name__}")
    flat = Flat({}, {}, None)
    flat.structure = _walk(state, "", flat)
    return flat


def _walk(node: Any, path: str, flat: Flat) -> Any:
    if isinstance(node, torch.Tensor):
        _claim(path, flat)
        flat.tensors[path] = node
        return _TENSOR
    if isinstance(node, Mapping):
        items = []
        for key, child in node.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"state key {key!r} under {path or 'the top level'!r} is a "
                                f"{type(key).__name__}; only str and int keys can be saved")
            items.append([key, _walk(child, join_name(path, key), flat)])
        return {"dict": items}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_walk(child, join_name(path, i), flat) for i, child in enumerate(node)]}
    value = checked_value(node, path)  # TypeError for what objects cannot hold
    _claim(path, flat)
    flat.objects[path] = value
    return _OBJECT


def join_name(path: str, key: Any) -> str:
    """The dotted name of ``key`` under ``path`` (``join_name("optim.state", 0) == "optim.state.0"``)."""
    return f"{path}.{key}" if path else str(key)


def _claim(path: str, flat: Flat) -> None:
    if path == "":
        raise TypeError("the state must be a dict, not a single leaf")
    if path in flat.tensors or path in flat.objects:
        raise TensorMismatchError(
            f"two leaves of the state flatten to the same name {path!r} (a key containing '.' "
            f"collides with a nested path); rename one of them"
        )


def unflatten(structure: Any, leaves: Mapping[str, Any], *, keep: set[str] | None = None) -> Any:
    """Rebuild the nested state from ``structure`` and the leaves by name.

    With ``keep``, only leaves whose names are in it are placed; containers
    left empty are dropped and list items keep their order but not their
    index. Without a structure (seed-format checkpoints), the result is the
    flat dict of leaves.
    """
    if structure is None:
        return {name: value for name, value in leaves.items() if keep is None or name in keep}
    built = _build(structure, "", leaves, keep)
    return {} if built is _MISSING else built


_MISSING = object()


def _build(node: Any, path: str, leaves: Mapping[str, Any], keep: set[str] | None) -> Any:
    if node in (_TENSOR, _OBJECT):
        if keep is not None and path not in keep:
            return _MISSING
        return leaves[path]
    (kind, children), = node.items()
    if kind == "dict":
        built = {key: _build(child, join_name(path, key), leaves, keep) for key, child in children}
        built = {k: v for k, v in built.items() if v is not _MISSING}
    else:
        built = [_build(child, join_name(path, i), leaves, keep) for i, child in enumerate(children)]
        built = [v for v in built if v is not _MISSING]
        built = tuple(built) if kind == "tuple" else built
    if keep is not None and path and not built:
        return _MISSING
    return built


def check_structure(structure: Any, tensor_names, object_names, *, source: str) -> None:
    """Raise :class:`MetadataError` unless ``structure`` (from a file) rebuilds exactly these leaves.

    Checks, without recursion (the JSON depth is bounded by the parser):
    every node is ``"T"``, ``"O"`` or ``{"dict": [[key, node], ...]}`` /
    ``{"list": [...]}`` / ``{"tuple": [...]}``, keys are str or int and
    unique within their dict, no two leaves share a dotted name, and the ``"T"`` leaves are exactly
    ``tensor_names`` and the ``"O"`` leaves exactly ``object_names``, so
    :func:`unflatten` can neither fail nor drop a leaf.

    >>> check_structure({"dict": [["w", "T"]]}, {"w"}, set(), source="metadata.json")
    """
    found = {_TENSOR: set(), _OBJECT: set()}
    stack: list[tuple[str, Any]] = [("", structure)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str) and node in found:
            if path in found[_TENSOR] or path in found[_OBJECT] or path == "":
                raise MetadataError(f"{source}: structure has two leaves named {path!r} (or a leaf at the top); "
                                    f"{_STRUCTURE_FIX}")
            found[node].add(path)
            continue
        stack.extend(_children(node, path, source))
    for kind, names, what in ((_TENSOR, tensor_names, "tensor_specs"), (_OBJECT, object_names, "objects")):
        if found[kind] != set(names):
            extra = sorted(found[kind] - set(names))[:3]
            missing = sorted(set(names) - found[kind])[:3]
            raise MetadataError(f"{source}: structure does not match {what}: leaves only in structure "
                                f"{extra}, names only in {what} {missing}; {_STRUCTURE_FIX}")


_STRUCTURE_FIX = "metadata.json is corrupt; load an earlier checkpoint"


def _children(node: Any, path: str, source: str) -> list[tuple[str, Any]]:
    if not (isinstance(node, dict) and len(node) == 1 and next(iter(node)) in ("dict", "list", "tuple")
            and isinstance(next(iter(node.values())), list)):
        raise MetadataError(f"{source}: structure node {path or '(top)'!r} is {short_repr(node)}; expected "
                            f'"T", "O" or {{"dict"|"list"|"tuple": [...]}}. {_STRUCTURE_FIX}')
    (kind, items), = node.items()
    if kind != "dict":
        return [(join_name(path, i), child) for i, child in enumerate(items)]
    children = []
    keys: set = set()
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                and not isinstance(item[0], bool)):
            raise MetadataError(f"{source}: structure entry under {path or '(top)'!r} is {short_repr(item)}; "
                                f"expected [key, node] with a str or int key. {_STRUCTURE_FIX}")
        if item[0] in keys:  # rebuilt as one dict, the second would replace the first and drop its leaves
            raise MetadataError(f"{source}: structure has the key {short_repr(item[0])} twice under "
                                f"{path or '(top)'!r}. {_STRUCTURE_FIX}")
        keys.add(item[0])
        children.append((join_name(path, item[0]), item[1]))
    return children


def select_names(all_names: list[str], keys) -> list[str]:
    """The names selected by ``keys``: exact names, or prefixes of dotted paths (``"optim"``).

    ``keys=None`` selects everything. A key that selects nothing raises
    :class:`TensorMismatchError` listing some of the names there are.
    """
    if keys is None:
        return list(all_names)
    if isinstance(keys, str):
        keys = [keys]
    chosen: dict[str, None] = {}
    for key in keys:
        hits = [n for n in all_names if n == key or n.startswith(key + ".")]
        if not hits:
            sample = ", ".join(sorted(all_names)[:8]) + (", ..." if len(all_names) > 8 else "")
            raise TensorMismatchError(f"key {key!r} is not in the checkpoint; it holds: {sample or 'nothing'}")
        chosen.update(dict.fromkeys(hits))
    return [n for n in all_names if n in chosen]

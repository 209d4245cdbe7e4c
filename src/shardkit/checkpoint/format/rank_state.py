"""Per-rank state (RNG states, a data loader's position): saved per rank, restored per rank.

``save(..., rank_state=...)`` takes a nested dict that differs between ranks.
Its tensors (the same shape and dtype on every rank, as RNG states are)
are stored as one chunked tensor ``__rank_state__.<name>`` of shape
``(world_size, *shape)`` whose row ``r`` is rank r's value, each row written
by its own rank; its plain leaves are stored as ``__rank_state__.<r>.<name>``
objects, gathered to rank 0 with the layout exchange in their ``metadata.json``
form (``storage.plain_values``: a loader's ``bytes`` state travels as base64).
Nothing else changes in the format (``docs/format.md``).

**The rule**: ``load(..., rank_state=...)`` fills rank r's ``rank_state`` in
place with saved rank r's values when the world size equals the saving one.
On another world size the ranks' values do not map onto the new ranks (an
RNG stream per old rank), so ``rank_state`` is left untouched and a
``UserWarning`` says so: re-seed per rank (e.g. ``seed + rank``) there.
Names starting with ``__rank_state__`` are reserved.

Example::

    rng = {"torch": torch.get_rng_state(), "epoch_offset": loader_pos}
    save(state, d, rank_state=rng)
    load(state, d, rank_state=rng); torch.set_rng_state(rng["torch"])
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardkit.checkpoint.format.nested import flatten
from shardkit.dtypes import to_safetensors_name
from shardkit.errors import TensorMismatchError
from shardkit.layout import Box
from shardkit.storage.plain_values import decode_value, encode_objects

__all__ = ["PREFIX", "rank_state_report", "rank_state_objects", "is_rank_state_name", "rank_state_targets",
           "warn_world_changed"]

PREFIX = "__rank_state__"


def is_rank_state_name(name: str) -> bool:
    return name == PREFIX or name.startswith(PREFIX + ".")


def check_reserved(names) -> None:
    clash = sorted(n for n in names if is_rank_state_name(n))
    if clash:
        raise TensorMismatchError(f"state_dict uses the reserved name {clash[0]!r}; names starting with "
                                  f"{PREFIX!r} hold per-rank state (rank_state=): rename it")


def rank_state_report(rank_state, rank: int, world_size: int) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(box report, local tensors, plain leaves)`` of this rank's ``rank_state`` under the reserved names.

    The plain leaves are JSON (encoded as ``metadata.json`` holds them), to be
    gathered to rank 0; :func:`rank_state_objects` decodes them there.
    """
    if rank_state is None:
        return {}, {}, {}
    flat = flatten(rank_state)
    report, local = {}, {}
    for name, t in flat.tensors.items():
        full = f"{PREFIX}.{name}"
        shape = [world_size, *t.shape]
        report[full] = [shape, to_safetensors_name(t.dtype), [rank] + [0] * t.dim(), [1, *t.shape]]
        local[full] = t.detach().unsqueeze(0)
    return report, local, encode_objects({f"{PREFIX}.{rank}.{n}": v for n, v in flat.objects.items()})


def rank_state_objects(statuses: list[dict]) -> dict[str, Any]:
    """Every rank's plain per-rank leaves (the values themselves), from the statuses gathered to rank 0."""
    out: dict[str, Any] = {}
    for s in statuses:
        out.update({name: decode_value(raw, f"rank_state leaf {name!r}") for name, raw in
                    (s.get("rank_objects") or {}).items()})
    return out


def rank_state_targets(rank_state, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Box], dict[str, str]]:
    """What ``load`` fills: tensors by saved name with their boxes, and plain leaf paths by saved name."""
    flat = flatten(rank_state)
    targets, boxes = {}, {}
    for name, t in flat.tensors.items():
        full = f"{PREFIX}.{name}"
        targets[full] = t.unsqueeze(0)      # a view: filling it fills t
        boxes[full] = Box((rank,) + (0,) * t.dim(), (1, *t.shape))
    plain = {f"{PREFIX}.{rank}.{n}": n for n in flat.objects}
    return targets, boxes, plain


def warn_world_changed(saved_world_size: int, world_size: int) -> None:
    warnings.warn(f"rank_state was saved by {saved_world_size} ranks and this job has {world_size}: per-rank "
                  f"values do not map onto other ranks, so rank_state was left as it was; seed it per rank",
                  UserWarning, stacklevel=3)

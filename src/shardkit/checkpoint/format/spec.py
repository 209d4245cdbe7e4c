"""How tensors are split across ranks: the spec types and their checks.

:class:`TensorShardSpec` describes one tensor (full shape, the dimension it
is split along, one size per rank); :class:`ShardMetadata` gathers them for
a checkpoint. This module validates specs and local tensors against them;
it does no I/O.

Example::

    spec = ShardMetadata(2, {"w": TensorShardSpec((10, 4), 0, (5, 5))})
    check_world(rank=1, world_size=2)
    check_spec("w", spec.tensor_specs["w"], 2, source="shard_spec")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from shardkit.checkpoint.format.nested import flatten
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import compute_shard_sizes

__all__ = [
    "TensorShardSpec",
    "ShardMetadata",
    "check_world",
    "check_spec",
    "local_shape",
    "flat_shard_metadata",
    "as_spec_dict",
]


@dataclass(frozen=True)
class TensorShardSpec:
    """One tensor's layout: ``shard_dim=None`` means replicated (every rank holds it whole)."""

    full_shape: tuple[int, ...]
    shard_dim: int | None
    shard_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        # Accept lists (JSON, user code) but keep the frozen value hashable and comparable.
        object.__setattr__(self, "full_shape", tuple(int(d) for d in self.full_shape))
        object.__setattr__(self, "shard_sizes", tuple(int(s) for s in self.shard_sizes))


@dataclass(frozen=True)
class ShardMetadata:
    """The layout of every sharded tensor of a checkpoint saved by ``num_ranks`` ranks."""

    num_ranks: int
    tensor_specs: dict[str, TensorShardSpec] = field(default_factory=dict)


def check_world(rank: int, world_size: int, *, what: str = "rank") -> None:
    """Refuse a world size below 1 or a rank outside ``0..world_size-1`` (:class:`MetadataError`).

    Rank errors are MetadataErrors (ValueErrors of the checkpoint branch):
    the pair describes the layout of the save or load being attempted.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise MetadataError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise MetadataError(
            f"{what} {rank!r} is out of range for world_size {world_size}; valid ranks are "
            f"0..{world_size - 1}. Pass this process's rank in the group that saves or loads."
        )


def check_spec(name: str, spec: TensorShardSpec, world_size: int, *, source: str) -> None:
    """Raise :class:`MetadataError` unless ``spec`` is a consistent layout for ``world_size`` ranks."""
    if any(d < 0 for d in spec.full_shape):
        raise MetadataError(f"{source}: tensor {name!r} has a negative dimension in full_shape {list(spec.full_shape)}")
    if spec.shard_dim is None:
        if spec.shard_sizes:
            raise MetadataError(
                f"{source}: tensor {name!r} is replicated (shard_dim null) but lists shard_sizes "
                f"{list(spec.shard_sizes)}; use shard_sizes=() for a replicated tensor"
            )
        return
    if not isinstance(spec.shard_dim, int) or not 0 <= spec.shard_dim < len(spec.full_shape):
        raise MetadataError(
            f"{source}: tensor {name!r} has shard_dim {spec.shard_dim!r}, but its full_shape "
            f"{list(spec.full_shape)} has {len(spec.full_shape)} dimensions"
        )
    if len(spec.shard_sizes) != world_size:
        raise MetadataError(
            f"{source}: tensor {name!r} has {len(spec.shard_sizes)} shard_sizes for {world_size} ranks; "
            f"give one size per rank"
        )
    total = spec.full_shape[spec.shard_dim]
    if sum(spec.shard_sizes) != total or any(s < 0 for s in spec.shard_sizes):
        raise MetadataError(
            f"{source}: shard_sizes {list(spec.shard_sizes)} of tensor {name!r} sum to "
            f"{sum(spec.shard_sizes)}, but dimension {spec.shard_dim} of full_shape "
            f"{list(spec.full_shape)} is {total}; e.g. compute_shard_sizes({total}, {world_size}) = "
            f"{compute_shard_sizes(total, world_size)}"
        )


def local_shape(spec: TensorShardSpec, rank: int) -> tuple[int, ...]:
    """The shape of the part of the tensor that ``rank`` holds."""
    if spec.shard_dim is None:
        return spec.full_shape
    shape = list(spec.full_shape)
    shape[spec.shard_dim] = spec.shard_sizes[rank]
    return tuple(shape)


def as_spec_dict(shard_spec, world_size: int) -> dict[str, TensorShardSpec]:
    """The per-tensor specs of ``shard_spec`` (a ShardMetadata, a mapping, or None), checked."""
    if shard_spec is None:
        return {}
    if isinstance(shard_spec, ShardMetadata):
        if shard_spec.num_ranks != world_size:
            raise MetadataError(
                f"shard_spec was built for {shard_spec.num_ranks} ranks, but world_size is {world_size}; "
                f"build it for the world that saves"
            )
        specs = shard_spec.tensor_specs
    elif isinstance(shard_spec, Mapping):
        specs = shard_spec
    else:
        raise TypeError(f"shard_spec must be a ShardMetadata, a dict of TensorShardSpec or None, "
                        f"got {type(shard_spec).__name__}")
    out = {}
    for name, spec in specs.items():
        if not isinstance(spec, TensorShardSpec):
            raise TypeError(f"shard_spec[{name!r}] is a {type(spec).__name__}, expected TensorShardSpec")
        check_spec(name, spec, world_size, source="shard_spec")
        out[name] = spec
    return out


def check_local_tensor(name: str, shape: tuple[int, ...], spec: TensorShardSpec, rank: int, world_size: int) -> None:
    """Raise :class:`TensorMismatchError` unless this rank's tensor has the shape the spec gives it."""
    want = local_shape(spec, rank)
    if tuple(shape) != want:
        where = ("replicated, so every rank holds the full shape" if spec.shard_dim is None else
                 f"sharded on dim {spec.shard_dim} with shard_sizes {list(spec.shard_sizes)}")
        raise TensorMismatchError(
            f"tensor {name!r} on rank {rank} of {world_size} has shape {list(shape)}, but the spec "
            f"(full_shape {list(spec.full_shape)}, {where}) gives this rank {list(want)}; fix the "
            f"shard_spec or pass this rank's slice"
        )


def flat_shard_metadata(state_dict, world_size: int) -> ShardMetadata:
    """FSDP-style layout: each local tensor is an equal 1-D chunk of a flat tensor.

    A tensor with ``n`` elements becomes ``full_shape=[n * world_size]``,
    ``shard_dim=0``, ``shard_sizes=[n] * world_size``. Local tensors should be
    1-D (save checks the shape). Non-tensor leaves are skipped. Nested state
    is named by dotted paths, as everywhere in ``shardkit.checkpoint``.

    >>> flat_shard_metadata({"w": torch.zeros(3)}, 4).tensor_specs["w"]
    TensorShardSpec(full_shape=(12,), shard_dim=0, shard_sizes=(3, 3, 3, 3))
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise MetadataError(f"world_size must be an integer >= 1, got {world_size!r}")
    flat = flatten(state_dict)
    specs = {
        name: TensorShardSpec((math.prod(t.shape) * world_size,), 0, (math.prod(t.shape),) * world_size)
        for name, t in flat.tensors.items()
    }
    return ShardMetadata(world_size, specs)

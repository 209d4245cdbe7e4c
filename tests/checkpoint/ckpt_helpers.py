"""Build per-rank states from a full state, and put rank outputs back together."""

import torch

from shardkit.checkpoint import ShardMetadata, TensorShardSpec, compute_shard_sizes, save_distributed


def rank_slice(full: torch.Tensor, dim: int | None, sizes, rank: int) -> torch.Tensor:
    if dim is None:
        return full
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


def save_full(full_state: dict, directory, world_size: int, dims: dict, *, sizes=None, extra=None,
              overwrite=False):
    """Save ``full_state`` (flat {name: tensor}) as ``world_size`` ranks would, sharding names in ``dims``."""
    specs = {}
    for name, dim in dims.items():
        t = full_state[name]
        s = (sizes or {}).get(name) or compute_shard_sizes(t.shape[dim], world_size)
        specs[name] = TensorShardSpec(tuple(t.shape), dim, tuple(s))
    meta = ShardMetadata(world_size, specs)
    for rank in range(world_size):
        local = {n: rank_slice(t, dims.get(n), list(specs[n].shard_sizes) if n in specs else None, rank)
                 for n, t in full_state.items()}
        local.update(extra or {})
        save_distributed(local, directory, rank, world_size, meta, overwrite=overwrite)
    return meta


def join_ranks(outputs: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    return outputs[0] if dim is None else torch.cat(outputs, dim)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs and -0.0 included), for any dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

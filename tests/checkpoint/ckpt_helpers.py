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


def save_v1(state_dict, directory, rank: int, world_size: int, shard_spec, *, metadata=None) -> None:
    """Write ``state_dict`` as shardkit's version-1 writer did (no group): tests of the version-1 readers.

    shardkit no longer writes version 1 (``save_distributed`` writes version 2); this fixture writes what
    it wrote, its JSON spelled out here (docs/format.md, "Version 1"): ``rank_<r>.safetensors`` (rank r's
    slice of each sharded tensor, plus the replicated tensors it owns, owners spread by bytes),
    ``rank_<r>.json`` with its file record and the save's ``save_id``, and, from rank 0,
    ``metadata.json`` (``format_version`` 1) with its own record only.
    """
    import json as _json

    import xxhash

    from shardkit.checkpoint.format.nested import flatten
    from shardkit.checkpoint.format.spec import as_spec_dict
    from shardkit.dtypes import to_safetensors_name
    from shardkit.storage import storage_for, write_safetensors
    from shardkit.storage.plain_values import encode_objects

    flat = flatten(state_dict)
    specs = as_spec_dict(shard_spec, world_size)
    replicated = {n: max(t.numel() * t.element_size(), 1) for n, t in flat.tensors.items()
                  if n not in specs or specs[n].shard_dim is None}
    load, owner_of = [0] * world_size, {}
    for name in sorted(replicated, key=lambda n: (-replicated[n], n)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owner_of[name], load[owner] = owner, load[owner] + replicated[name]
    tensor_specs = {}
    for name, t in flat.tensors.items():
        spec = specs.get(name) or TensorShardSpec(tuple(t.shape), None, ())
        tensor_specs[name] = {"full_shape": list(spec.full_shape), "shard_dim": spec.shard_dim,
                              "shard_sizes": list(spec.shard_sizes), "dtype": to_safetensors_name(t.dtype),
                              **({"owner_rank": owner_of[name]} if name in owner_of else {})}
    user_metadata = dict(metadata or {})
    text = _json.dumps([tensor_specs, flat.objects, flat.structure, user_metadata], sort_keys=True, default=str)
    save_id = xxhash.xxh3_64_hexdigest(text.encode())
    storage, root = storage_for(str(directory))
    storage.makedirs(root)
    names = (["metadata.json"] if rank == 0 else []) + [f"rank_{rank}.json"]
    storage.remove_files([storage.join(root, n) for n in names])
    named = [(n, t) for n, t in flat.tensors.items() if n not in owner_of or owner_of[n] == rank]
    file_name = f"rank_{rank}.safetensors"
    record = write_safetensors(storage, storage.join(root, file_name), named,
                               {"format": "pt", "shardkit.rank": str(rank), "shardkit.num_ranks": str(world_size)})
    files = {file_name: record.to_json()}
    _write(storage, storage.join(root, f"rank_{rank}.json"),
           {"format": "shardkit.distributed.rank", "format_version": 1, "rank": rank, "num_ranks": world_size,
            "files": files, "save_id": save_id})
    if rank == 0:
        _write(storage, storage.join(root, "metadata.json"),
               {"format": "shardkit.distributed", "format_version": 1, "num_ranks": world_size,
                "tensor_specs": tensor_specs, "files": files, "objects": encode_objects(flat.objects),
                "structure": flat.structure, "user_metadata": user_metadata, "save_id": save_id})


def _write(storage, path, obj) -> None:
    import json as _json

    with storage.atomic_writer(path) as f:
        f.write(_json.dumps(obj, allow_nan=False).encode())


def save_full_v1(full_state: dict, directory, world_size: int, dims: dict, *, extra=None):
    """:func:`save_full`, written in version 1 (:func:`save_v1`)."""
    specs = {n: TensorShardSpec(tuple(full_state[n].shape), d, tuple(compute_shard_sizes(full_state[n].shape[d],
                                                                                         world_size)))
             for n, d in dims.items()}
    meta = ShardMetadata(world_size, specs)
    for rank in range(world_size):
        local = {n: rank_slice(t, dims.get(n), list(specs[n].shard_sizes) if n in specs else None, rank)
                 for n, t in full_state.items()}
        local.update(extra or {})
        save_v1(local, directory, rank, world_size, meta)
    return meta

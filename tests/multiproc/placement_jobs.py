"""Rank functions for the DTensor placement tests (importable by the rank processes)."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

import shardkit.checkpoint as ckpt
from shardkit.errors import TensorMismatchError

FULL = torch.arange(16.0).reshape(8, 2)


class Unknown(Placement):
    """A placement shardkit does not know (nor does torch's shape helper)."""

    def __eq__(self, other):
        return type(other) is Unknown

    def __hash__(self):
        return 7


def _attempt(fn) -> str | None:
    try:
        fn()
    except TensorMismatchError as e:
        return str(e)
    return None


def _files(d) -> list:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def interleaved_strided(rank, world_size, saved, fresh):
    """(Shard(0), _StridedShard(0, 2)) on a 2x2 mesh: rank (0, 0) holds rows {0, 2}, not one box."""
    mesh = init_device_mesh("cpu", (2, 2))
    placements = [Shard(0), _StridedShard(0, split_factor=2)]
    local = FULL
    for dim, p in enumerate(placements):
        local = p._split_tensor(local, 2, with_padding=False)[0][mesh.get_coordinate()[dim]]
    target = DTensor.from_local(torch.full_like(local.contiguous(), -1.0), mesh, placements, run_check=False,
                                shape=FULL.shape, stride=FULL.stride())
    load_error = _attempt(lambda: ckpt.load({"w": target}, saved))
    untouched = bool((target.to_local() == -1).all())
    mine = DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                              shape=FULL.shape, stride=FULL.stride())
    save_error = _attempt(lambda: ckpt.save({"w": mine}, fresh))
    return load_error, untouched, save_error, _files(fresh)


def unknown_placement(rank, world_size, fresh):
    mesh = init_device_mesh("cpu", (world_size,))
    t = DTensor.from_local(torch.full((4, 2), float(rank)), mesh, [Unknown()], run_check=False,
                           shape=(4, 2), stride=(2, 1))
    return _attempt(lambda: ckpt.save({"w": t}, fresh)), _files(fresh)


def outside_the_mesh(rank, world_size, saved):
    """A DTensor on ranks 0 and 1 only; ranks 2 and 3 load it too and hold nothing."""
    sub = DeviceMesh("cpu", [0, 1])
    local = FULL[:4] if rank == 0 else FULL[4:] if rank == 1 else torch.empty(0)
    t = DTensor.from_local(torch.zeros_like(local), sub, [Shard(0)], run_check=False,
                           shape=FULL.shape, stride=FULL.stride())
    ckpt.load({"w": t}, saved)
    return t.to_local().tolist()

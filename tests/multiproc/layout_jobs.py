"""Rank functions for the compact-layout tests (importable by the forkserver ranks)."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardkit.checkpoint as ckpt
from shardkit.checkpoint.planning.chunk_plan import plan_chunks
from shardkit.checkpoint.planning.compact_layout import describe, own_boxes_agree
from shardkit.checkpoint.planning.dtensor_layout import local_box
from shardkit.checkpoint.coordination.group import EXCHANGE_OBSERVERS


def random_state(seed: int, meshes) -> dict:
    """Seeded DTensors on ``meshes`` (the same on every rank): random shapes (uneven, empty
    shards) and Shard / Replicate placements, plus a plain tensor."""
    rng = random.Random(seed)
    state = {"plain": torch.arange(5, dtype=torch.float64)}
    for i in range(12):
        mesh = meshes[rng.randrange(len(meshes))]
        shape = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        placements = [rng.choice([Replicate()] + [Shard(d) for d in range(len(shape))]) for _ in mesh.shape]
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 100 * i
        state[f"t{i}"] = distribute_tensor(full, mesh, placements)
    return state


def count_collectives(fn) -> int:
    counted = []

    def observe(rank, collectives, received_bytes, sent_bytes):
        counted.append(collectives)

    EXCHANGE_OBSERVERS.append(observe)
    try:
        fn()
    finally:
        EXCHANGE_OBSERVERS.remove(observe)
    return sum(counted)


def every_box(state) -> list[dict]:
    """Every rank's box of every tensor (what the fallback exchanges), all-gathered."""
    mine = {}
    for name, t in state.items():
        box, _ = local_box(name, t)
        mine[name] = (tuple(t.shape), "F64" if t.dtype == torch.float64 else "F32", box.offsets, box.sizes)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def layout_job(rank, world_size, root, seeds):
    """Per seed: the predicted boxes are the held ones, the save takes the compact path (6
    collectives), and the box reports every rank holds (for the test to compare with metadata.json)."""
    meshes = [init_device_mesh("cpu", (world_size,)),
              init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))]
    out = {}
    for seed in seeds:
        state = random_state(seed, meshes)
        boxes = {n: local_box(n, t)[0] for n, t in state.items()}
        agree = own_boxes_agree(describe(state, {}, world_size), boxes, dist.get_rank(), rank)
        collectives = count_collectives(lambda: ckpt.save(state, f"{root}/s{seed}"))
        reports = every_box(state)
        plan = plan_chunks(reports, lambda d: 4)
        out[seed] = {"agree": agree, "collectives": collectives, "reports": reports,
                     "boxes": {n: sorted((b.offsets, b.sizes) for b in t.box_to_writer)
                               for n, t in plan.tensors.items()}}
    return out


def model_kinds_job(rank, world_size, root, kinds):
    """The collectives of saving an FSDP2 / HSDP / FSDP x TP model and optimizer state."""
    from dtensor_jobs import parallel, state, train_step

    out = {}
    for kind in kinds:
        model, optim = parallel(kind, seed=1, world_size=world_size)
        train_step(model, optim, 0)
        sd = state(model, optim, step=1)
        out[kind] = count_collectives(lambda: ckpt.save(sd, f"{root}/{kind}"))
    return out

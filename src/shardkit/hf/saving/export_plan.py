"""Plan a Hugging Face export: which tensors, in which dtype, written by which rank, into which file.

Pure: names, byte counts and dtypes in, plain data out; no tensors are read
and no file is touched, so every rank of a job computes the same plan from
the same facts, and tests drive it with integers. One planner serves every
HF writer of shardkit: ``save_checkpoint`` in a job (several ranks), and
the offline exports (``distributed_to_hf``, ``shardkit convert --to hf``) as
one rank. Not here: moving bytes between ranks, writing files.

- :func:`assign_writers` balances whole tensors over ranks by bytes
  (largest first, each to the least-loaded rank).
- :func:`plan_export` cuts each rank's tensors, in the order given, into
  ``model-0000k-of-0000n`` files of at most ``max_shard_bytes`` (rank 0's
  files first); with one rank it is exactly ``index.plan_shards``.
- :func:`select_model_names` picks a checkpoint's model tensors (no
  optimizer state, no ``__rank_state__``) and their exported names.

Example::

    plan = plan_export([("a", 600), ("b", 400), ("c", 300)], world_size=2, max_shard_bytes=10**9,
                       safetensors=True)
    [(f.name, f.rank, f.names) for f in plan.files]
    # [('model-00001-of-00002.safetensors', 0, ('a',)), ('model-00002-of-00002.safetensors', 1, ('b', 'c'))]
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shardkit.checkpoint.format.rank_state import PREFIX as RANK_STATE_PREFIX
from shardkit.errors import TensorMismatchError
from shardkit.hf.index import plan_shards, shard_file_name

__all__ = ["ShardFile", "ExportPlan", "assign_writers", "plan_export", "out_dtype", "select_model_names",
           "TRAINING_STATE_NAMES"]

log = logging.getLogger("shardkit.hf")


@dataclass(frozen=True)
class ShardFile:
    """One shard file of an export: its name, the rank that writes it, the tensors in it and their bytes."""

    name: str
    rank: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class ExportPlan:
    """Every shard file of an export, in number order."""

    files: tuple[ShardFile, ...]

    @property
    def weight_map(self) -> dict[str, str]:
        """``{tensor name: file name}``, the index's ``weight_map``."""
        return {n: f.name for f in self.files for n in f.names}

    def files_of(self, rank: int) -> list[ShardFile]:
        """The files ``rank`` writes, in number order."""
        return [f for f in self.files if f.rank == rank]

    def bytes_of(self, rank: int) -> int:
        return sum(f.nbytes for f in self.files_of(rank))


def assign_writers(name_bytes: Sequence[tuple[str, int]], world_size: int) -> dict[str, int]:
    """``{name: rank}``: each whole tensor to one of ``world_size`` ranks, balanced by bytes.

    Largest first, each to the rank with the fewest bytes so far (the lowest
    rank on a tie; equal sizes keep their given order): no rank gets more
    than ``total / world_size + the largest tensor``. Deterministic, so every
    rank computes the same answer. Does not split a tensor.

    >>> assign_writers([("a", 5), ("b", 3), ("c", 3)], 2)
    {'a': 0, 'b': 1, 'c': 1}
    """
    if world_size < 1:
        raise TensorMismatchError(f"an export needs at least one rank to write it, got world_size={world_size}")
    loads = [(0, rank) for rank in range(world_size)]
    order = sorted(range(len(name_bytes)), key=lambda i: (-name_bytes[i][1], i))
    writer: dict[str, int] = {}
    for i in order:
        load, rank = heapq.heappop(loads)
        name, nbytes = name_bytes[i]
        writer[name] = rank
        heapq.heappush(loads, (load + nbytes, rank))
    return {name: writer[name] for name, _ in name_bytes}


def plan_export(name_bytes: Sequence[tuple[str, int]], world_size: int, max_shard_bytes: int,
                safetensors: bool = True) -> ExportPlan:
    """The files of an export of ``(name, nbytes)`` tensors written by ``world_size`` ranks.

    Each rank's tensors (:func:`assign_writers`) keep the order given and
    are cut into files of at most ``max_shard_bytes`` (more only for a
    single tensor that alone is larger); files are numbered rank by rank.
    Names must be unique. Pure.

    >>> [f.names for f in plan_export([("a", 6), ("b", 6), ("c", 1)], 1, 10).files]
    [('a',), ('b', 'c')]
    """
    names = [n for n, _ in name_bytes]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise TensorMismatchError(f"an export names {twice[:5]} more than once; each tensor is written once")
    writer = assign_writers(name_bytes, world_size)
    nbytes_of = dict(name_bytes)
    cut = [(rank, shard) for rank in range(world_size)
           for shard in plan_shards([(n, b) for n, b in name_bytes if writer[n] == rank], max_shard_bytes)]
    files = tuple(ShardFile(shard_file_name(i + 1, len(cut), safetensors), rank, tuple(shard),
                            sum(nbytes_of[n] for n in shard))
                  for i, (rank, shard) in enumerate(cut))
    return ExportPlan(files)


def out_dtype(saved: torch.dtype, wanted: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a tensor is exported in: ``wanted`` for a floating tensor, else as saved (ids stay integers)."""
    return wanted if wanted is not None and saved.is_floating_point else saved


#: Top-level names of a training checkpoint's state beside its model, left out of a model export.
TRAINING_STATE_NAMES = frozenset({
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "lr_scheduler", "scheduler",
    "schedulers", "scaler", "grad_scaler", "step", "epoch", "rng", "rng_state", "dataloader", "trainer",
    "extra_state", "train_state", RANK_STATE_PREFIX,
})


def select_model_names(names, prefix: Optional[str]) -> dict[str, str]:
    """``source name -> exported name``: a checkpoint's model tensors, by default; the subtree ``prefix``.

    ``prefix=None`` (the default of every export) leaves out the top-level
    training state (:data:`TRAINING_STATE_NAMES`: optimizer moments, scheduler,
    step, the per-rank ``__rank_state__``), saying so in a log line; if what
    is left is one ``model`` subtree, its ``model.`` is stripped (a
    ``{"model": ..., "optim": ...}`` training state gives the model's own
    names), otherwise names are kept (a Hugging Face model's ``model.*``
    beside ``lm_head.weight`` keeps both). ``prefix=""`` exports every
    tensor as named, optimizer state included. Any other ``prefix`` is a
    subtree (``"model"`` means ``"model."``), stripped; no name under it
    raises ``TensorMismatchError``. Pure.

    >>> sorted(select_model_names(["model.w", "optim.state.0.exp_avg", "__rank_state__.rng"], None).items())
    [('model.w', 'w')]
    >>> sorted(select_model_names(["model.w", "lm_head.weight"], None))
    ['lm_head.weight', 'model.w']
    """
    names = list(names)
    if prefix is None:
        return _default_selection(names)
    if not prefix:
        return {n: n for n in names}
    return _subtree(names, prefix if prefix.endswith(".") else prefix + ".")


def _default_selection(names: list) -> dict[str, str]:
    tops = {n.split(".", 1)[0] for n in names}
    left_out = tops & TRAINING_STATE_NAMES
    kept = [n for n in names if n.split(".", 1)[0] not in left_out]
    if not kept:  # nothing but training state: export it as named rather than nothing
        return {n: n for n in names}
    if left_out:
        log.warning("exporting the model tensors only, leaving out %s; pass prefix '' (--prefix '') to "
                    "export everything", ", ".join(sorted(left_out)))
    if {n.split(".", 1)[0] for n in kept} == {"model"} and left_out:
        return _subtree(kept, "model.")
    return {n: n for n in kept}


def _subtree(names: list, prefix: str) -> dict[str, str]:
    chosen = {n: n[len(prefix):] for n in names if n.startswith(prefix) and len(n) > len(prefix)}
    if not chosen:
        tops = sorted({n.split(".", 1)[0] + "." for n in names})
        raise TensorMismatchError(f"no tensor name starts with {prefix!r}; the checkpoint's top-level "
                                  f"prefixes are {tops[:10]}. Pass one of them, or '' for every tensor")
    return chosen

"""``Prepared``: one rank's planned save, handed from planning to writing and committing.

Made by ``chunked_save.prepare`` (``save``, ``async_save``, the manager) and
``distributed_save`` (``save_distributed``); read by ``chunked_save.write_and_commit``.
It holds no file handle and does no I/O.

Example::

    prep = prepare(state, None, 0, 1, metadata=None, rank_state=None)
    prep.to_write        # name -> the tensor this rank writes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardkit.checkpoint.planning.chunk_plan import ChunkPlan
from shardkit.checkpoint.planning.grid_plan import GridPlan
from shardkit.storage.fast_io.write_mode import FOREGROUND, WriteMode

__all__ = ["Prepared"]


@dataclass
class Prepared:
    """A planned save: what this rank writes, and (rank 0, or whoever commits) what ``metadata.json`` holds."""

    rank: int
    world_size: int
    full_plan: Callable[[], ChunkPlan | GridPlan]    # every rank's writes (rank 0 calls it when it commits)
    to_write: dict[str, torch.Tensor]     # name -> the local tensor this rank writes
    objects: dict[str, Any]
    structure: Any
    user_metadata: dict
    split_dims: dict[str, int] = field(default_factory=dict)   # name -> shard_spec dimension (save_distributed)
    #: name -> shard_spec sizes, for the split tensors without an element (no chunk tells their sizes)
    empty_split_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    boxes: dict[str, tuple] = field(default_factory=dict)   # name -> (full shape, this rank's Box) of to_write
    base_dir: str | None = None      # incremental save: the sibling checkpoint unchanged chunks are referenced in
    base_view: Any = None            # its BaseView, read by the writing step (incremental.read_base)
    write_mode: WriteMode = FOREGROUND    # background saves: WriteMode.background() (the knobs)
    #: name -> (file key, file record checksum) where the base keeps the bytes the staging proved equal
    #: (``checkpoint.background.staged_proof``): referenced without reading the base there
    proven: dict[str, tuple[str, str]] = field(default_factory=dict)
    written: dict | None = None      # what writing this rank's file returned (``_write_file``), once written

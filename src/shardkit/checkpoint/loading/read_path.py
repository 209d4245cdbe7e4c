"""One open checkpoint: ``metadata.json`` read once, data files opened once, every region read from it.

:func:`open_checkpoint` is the read path the loaders share: it reads and
checks the manifest once (seed and version-1 layouts are upgraded to chunks
when a load is planned, in ``plan.saved_chunks``), opens each data file on
first use (size checked against its record, header parsed once) and keeps it
open until :meth:`OpenCheckpoint.close`. Reading many tensors or boxes one
after another (a converter, a reshard that streams) therefore pays for the
manifest and the file headers once, not per tensor. It never writes, and it
does not load plain values into tensors or build nested states itself
(``load_distributed`` does, on top of it).

Example::

    with open_checkpoint("/ckpt/step-100") as ck:
        for name in ck.manifest.tensors:
            part = ck.region(name, (0, 0), (16, 1024))
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardkit.checkpoint.loading.execute import OpenFiles, check_chunks, run_loads, saved_dtype, scratch_elems_of
from shardkit.checkpoint.format.manifest import Manifest, read_manifest
from shardkit.checkpoint.planning.plan import plan_load
from shardkit.errors import TensorMismatchError
from shardkit.layout import Box
from shardkit.storage import FileRecord, storage_for

__all__ = ["OpenCheckpoint", "open_checkpoint"]


class OpenCheckpoint:
    """A checkpoint opened for reading; see the module docstring. Also a context manager.

    ``verify`` as in ``load_distributed``: None means ``knobs.VERIFY_ON_LOAD``
    (on: every checksum block whose bytes a read returns is hashed before it
    returns, mapped outputs included); True: private copies (never a map),
    every block hashed; False: nothing hashed.
    """

    def __init__(self, dir, *, verify: bool | None = None):
        self.storage, self.directory = storage_for(dir)
        self.manifest: Manifest = read_manifest(self.storage, self.directory)
        self._verify = verify
        self._files: OpenFiles | None = None

    @property
    def records(self) -> dict[str, FileRecord]:
        """The record (size, block checksums) of every data file, by file name ({} for the seed format)."""
        return self._open_files().records

    def dtype(self, name: str) -> torch.dtype:
        """The saved dtype of tensor ``name`` (from its file's header where the manifest has none)."""
        return saved_dtype(self._open_files(), name, self.manifest.tensors[name])

    def boxes(self, want: dict[str, Box], out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Each ``name -> box`` of ``want`` as a tensor; only the overlapping byte ranges are read.

        ``out`` (by name, optional): contiguous CPU tensors of the box's shape
        and the saved dtype, read into with no temporary. The others are
        allocated, or mapped zero-copy (``knobs.MAP_LOADS``); verified per
        ``verify`` either way, before this returns.
        """
        files = self._open_files()
        tensors = self.manifest.tensors
        dtypes = {n: saved_dtype(files, n, tensors[n]) for n in want}
        check_chunks(files, tensors, want, dtypes)  # claimed shapes vs the files, before planning
        plans = plan_load(tensors, want, scratch_elems_of(dtypes))
        return run_loads(files, plans, dtypes.__getitem__, out)

    def region(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box ``offsets`` / ``sizes`` of tensor ``name``, checked against its full shape."""
        if name not in self.manifest.tensors:
            raise TensorMismatchError(f"{self.directory} has no tensor {name!r}; it holds: "
                                      f"{', '.join(sorted(self.manifest.tensors)[:8]) or 'none'}")
        box = check_box(name, self.manifest.tensors[name].spec.full_shape, offsets, sizes)
        return self.boxes({name: box})[name]

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None

    def __enter__(self) -> "OpenCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def files(self) -> OpenFiles:
        """The data files, opened on first use and held until :meth:`close` (for the loaders built on this)."""
        return self._open_files()

    def _open_files(self) -> OpenFiles:
        if self._files is None:
            self._files = OpenFiles.for_load(self.storage, self.directory, self.manifest, self._verify)
        return self._files


def open_checkpoint(dir, *, verify: bool | None = None) -> OpenCheckpoint:
    """Open the checkpoint in ``dir`` for reading (manifest read and checked now, files on first use)."""
    return OpenCheckpoint(dir, verify=verify)


def check_box(name: str, full_shape: tuple[int, ...], offsets, sizes) -> Box:
    """``offsets`` / ``sizes`` as a :class:`Box` inside ``full_shape``; ``TensorMismatchError`` otherwise."""
    offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    if len(offsets) != len(full_shape) or len(sizes) != len(full_shape):
        raise TensorMismatchError(f"tensor {name!r} has {len(full_shape)} dimensions (full shape "
                                  f"{list(full_shape)}); got {len(offsets)} offsets and {len(sizes)} sizes")
    for d, (o, s, n) in enumerate(zip(offsets, sizes, full_shape)):
        if o < 0 or s < 0 or o + s > n:
            raise TensorMismatchError(f"box offsets {list(offsets)} sizes {list(sizes)} leaves tensor "
                                      f"{name!r} of full shape {list(full_shape)} in dimension {d}")
    return Box(offsets, sizes)

"""Loading: one rank's slices on any world size, any box, or the whole state.

Every function reads ``metadata.json`` (and, where needed, the per-rank
manifests), plans the byte ranges that overlap what is wanted
(``plan.py``) and reads only those (``execute.py``). Nothing is loaded
whole unless it is asked for whole.

**Verification** (``verify=None`` means ``knobs.VERIFY_ON_LOAD``, **True**):
every load of this format hashes each checksum block whose bytes it
returns, whole, and compares it with the saved record (each file's header
too), so a corrupt byte raises :class:`ChecksumError` (naming the file, the
block, the tensor and ``shardkit validate``) instead of loading:

- a load that copies (in place ``out=``, a resharded slice that is not one
  byte range, ``verify=True``) hashes each byte in the same pass that copies
  it (1 GiB on the 2-core box: a load into fresh memory takes 0.90-1.13x,
  median 1.05x, the unverified one's time, an in-place ``out=`` load
  1.03-1.12x, where no page fault hides the hash); after an in-place load
  raised it, the tensors may hold the bad block's bytes;
- a **zero-copy** load (below) hashes the whole blocks its maps lie in, from
  the mapped pages themselves, on the I/O threads, **before it returns**
  (``storage.safetensors_format.tensor_io.map_verified``): the caller never holds a mapped
  byte that was not verified, and the pass is also the pages' first touch
  (a fresh 1 GiB load with every page touched, 2-core VM shared with other
  jobs, 21 interleaved rounds: median 0.19 s verified, 0.10 s unverified,
  3.9 s for ``dcp.load``; the per-round difference a median 0.6 of one xxh3
  pass over the same bytes, 0.1-1.5 of one; ``shardkit bench --only load``);
- from an object store, a block this rank needs only part of is downloaded
  whole and verified while the load's allowance of
  ``knobs.VERIFY_EXTRA_READ_FRACTION`` (0.1) of its bytes lasts (at most
  1.1x the rank's bytes downloaded); past it such a block is read
  unverified (``validate_distributed`` checks every byte); blocks it reads
  whole are always hashed.

``verify=False`` (or ``knobs.VERIFY_ON_LOAD = False``) hashes nothing.
Every load still refuses a file whose size differs from its record
(:class:`IncompleteCheckpointError`) and any header that does not match the
metadata. Seed-format directories have no checksums; their sizes are
checked against the headers. What no load can check: a file changed in
place after the load returned shows through a mapped tensor (as through any
map; shardkit's saves replace files by rename).

**Zero-copy**: where this rank's whole output tensor is one contiguous byte
range of one local file (the same-world-size load, a replicated tensor, a
``Shard(0)`` chunk) and ``out`` is not given, the tensor is returned over a
private (copy-on-write) map of that range instead (``knobs.MAP_LOADS``):
pages are shared with the page cache, writes never reach the file, and a
file truncated in place while it lives raises SIGBUS (shardkit's saves
replace files by rename). ``verify=True`` asks for private copies instead
(copied and hashed); ``knobs.MAP_LOADS = False`` copies too.

**In place** (``out=``): :func:`load_distributed` can fill the tensors a
training job already has, like ``torch.distributed.checkpoint.load`` or
``module.load_state_dict``: no second copy of the state, no fresh pages.
Contiguous CPU tensors are read into directly; GPU and non-contiguous ones
through bounded CPU temporaries (``load_into.py``). Names, shapes and dtypes
must match this rank's slices exactly (nothing is cast); all are checked
before a byte is read.

Example::

    state = load_distributed("/ckpt/step-10", rank=1, world_size=3)   # saved on 4 ranks
    load_distributed("/ckpt/step-10", rank=1, world_size=3, out={"model": model.state_dict()})
    block = load_region("/ckpt/step-10", "layers.0.w", (0, 128), (16, 64))
"""

from __future__ import annotations

from typing import Sequence

import torch

from shardkit.checkpoint.loading.load_into import load_into
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.format.manifest import Manifest, read_manifest
from shardkit.checkpoint.format.nested import select_names, unflatten
from shardkit.checkpoint.loading.read_path import open_checkpoint
from shardkit.checkpoint.planning.plan import wanted_box
from shardkit.checkpoint.format.spec import check_world
from shardkit.errors import MetadataError
from shardkit.layout import whole_box
from shardkit.storage import storage_for

__all__ = ["load_distributed", "reshard", "load_region", "load_consolidated", "read_metadata"]


def read_metadata(dir) -> Manifest:
    """The parsed ``metadata.json`` of a checkpoint directory (no data is read)."""
    storage, directory = storage_for(dir)
    return read_manifest(storage, directory)


@logged("load_distributed")
def load_distributed(dir, rank, world_size, *, keys=None, device="cpu", verify=None, out=None) -> dict:
    """This rank's part of the checkpoint, as the nested state that was saved.

    Sharded tensors come back as this rank's slice: the saved slice when
    ``world_size`` equals the saving world size, else the
    ``compute_shard_sizes`` split of the same dimension (resharding).
    Replicated tensors come back whole, and so do the tensors ``save``
    wrote from DTensors (their layout is a mesh's, not a split of one
    dimension: to read only this rank's box of those, ``load`` into DTensors
    of the mesh you want); plain leaves come back as saved. ``keys``
    (dotted names or prefixes) restricts what is read. It does not load the
    other ranks' bytes. Seed-format directories come back as a flat dict.

    With ``out`` (a nested state, e.g. ``{"model": model.state_dict(), ...}``)
    nothing is allocated: each tensor leaf of ``out`` is filled in place with
    the slice above (only those tensors are read; with ``keys`` too, only
    those both select), plain leaves the checkpoint also holds are replaced
    in their container, and ``out`` itself is returned. ``device`` is then
    ignored: every tensor stays where it is (CPU, GPU). A leaf the checkpoint
    lacks, a shape other than this rank's slice or a dtype other than the
    saved one raises :class:`TensorMismatchError` before anything is read,
    leaving ``out`` untouched; nothing is cast and no leaf is added.

    **Verified** (``verify=None``: ``knobs.VERIFY_ON_LOAD``, on): every
    checksum block whose bytes are returned is hashed before the call
    returns, and a corrupt one raises :class:`ChecksumError`; ``verify=False``
    skips it. See the module docstring for what each path hashes (object
    stores: blocks read only in part, within a 1.1x download allowance).

    **Zero-copy** (without ``out``; ``knobs.MAP_LOADS``, on by default): a
    tensor whose whole output is one contiguous byte range of one local file
    (the same-world-size load, a replicated tensor, a ``Shard(0)`` chunk)
    comes back over a private, copy-on-write map of that range, its blocks
    hashed from the mapped pages before the call returns (so its pages are
    mapped in, shared with the page cache and with every process mapping
    the same file, until written); writes stay private and never reach the
    file. A file truncated or rewritten in place while they live makes a
    touch die with SIGBUS (shardkit's saves replace files by rename, so
    saving over the checkpoint is safe). To get private copies pass
    ``verify=True`` (copies and hashes every byte), or set
    ``knobs.MAP_LOADS = False`` (copies, hashed per ``knobs.VERIFY_ON_LOAD``).

    >>> load_distributed("/ckpt/step-10", rank=0, world_size=3)["model"]["w"].shape
    >>> state = {"model": model.state_dict(), "step": 0}
    >>> load_distributed("/ckpt/step-10", rank=0, world_size=3, out=state) is state
    True
    """
    check_world(rank, world_size)
    with open_checkpoint(dir, verify=verify) as ck:
        m = ck.manifest
        if out is not None:
            return load_into(out, ck, rank, world_size, keys=keys)
        names = select_names(list(m.tensors) + list(m.objects), keys)
        want = {n: wanted_box(m.tensors[n], m.num_ranks, rank, world_size) for n in names if n in m.tensors}
        tensors = ck.boxes(want)
    leaves = {**{n: m.objects[n] for n in names if n in m.objects}, **_to_device(tensors, device)}
    return unflatten(m.structure, leaves, keep=set(names) if keys is not None else None)


def reshard(dir, old_world_size, new_world_size, new_rank, *, verify=None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint saved on ``old_world_size`` ranks, as ``new_rank`` of ``new_world_size`` holds it.

    Returns a flat ``{dotted name: tensor}`` dict (no plain leaves: use
    :func:`load_distributed` for the nested state). Reads only overlapping
    bytes; zero-copy and verified as :func:`load_distributed` is
    (``verify=False`` skips the hash).

    >>> reshard("/ckpt/step-10", 4, 3, 0)["layers.0.w"].shape
    """
    check_world(new_rank, new_world_size, what="new_rank")
    with open_checkpoint(dir, verify=verify) as ck:
        m = ck.manifest
        if old_world_size != m.num_ranks:
            raise MetadataError(f"old_world_size is {old_world_size}, but {ck.directory} was saved by "
                                f"{m.num_ranks} ranks (metadata.json num_ranks); pass {m.num_ranks}")
        return ck.boxes({n: wanted_box(t, m.num_ranks, new_rank, new_world_size) for n, t in m.tensors.items()})


def load_region(dir, name, offsets: Sequence[int], sizes: Sequence[int], *, verify=None) -> torch.Tensor:
    """The box ``offsets``/``sizes`` of the saved tensor ``name`` (any box, across any chunks).

    Equals ``full[o0:o0+s0, o1:o1+s1, ...]`` without building ``full``.
    Every checksum block the box's bytes lie in is hashed whole before it
    returns (mapped or copied; ``verify=False`` skips it), so a corrupt
    block raises :class:`ChecksumError` and an intact one of the same file loads.

    >>> load_region("/ckpt/step-10", "emb", (100, 0), (8, 1024)).shape
    torch.Size([8, 1024])
    """
    with open_checkpoint(dir, verify=verify) as ck:
        return ck.region(name, offsets, sizes)


def load_consolidated(dir, *, keys=None, verify=None) -> dict:
    """The full, unsharded state (nested as saved): every tensor whole. Memory: the whole state.

    Tensors saved in one piece come back zero-copy, the others copied; all
    verified before it returns (``verify=False`` skips the hash), as
    :func:`load_distributed`.

    >>> load_consolidated("/ckpt/step-10")["model"]["w"].shape     # the full shape
    """
    with open_checkpoint(dir, verify=verify) as ck:
        m = ck.manifest
        names = select_names(list(m.tensors) + list(m.objects), keys)
        tensors = ck.boxes({n: whole_box(m.tensors[n].spec.full_shape) for n in names if n in m.tensors})
    leaves = {**{n: m.objects[n] for n in names if n in m.objects}, **tensors}
    return unflatten(m.structure, leaves, keep=set(names) if keys is not None else None)


def _to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    return {n: t.to(device) for n, t in tensors.items()}

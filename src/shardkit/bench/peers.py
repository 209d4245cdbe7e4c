"""What a user would otherwise pick: the peers' save and load, and the raw limits.

Each function does the same work as its shardkit counterpart on the same
state, including making the result durable (fsync) where the case says so.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from shardkit.storage import byte_view


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (for peers that do not fsync themselves)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextlib.contextmanager
def single_process_dcp():
    """DCP warns on every call without a process group that it assumes one process, as meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def dcp_save(state: dict, path: str, process_group=None) -> None:
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), process_group=process_group)


def dcp_load(template: dict, path: str, process_group=None) -> dict:
    """DCP loads in place: the destination tensors are allocated here, then filled."""
    state = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in template.items()}
    return dcp_load_into(state, path, process_group)


def dcp_load_into(dest: dict, path: str, process_group=None) -> dict:
    """DCP's own way: fill the tensors of ``dest`` (allocated by the caller) in place."""
    import torch.distributed.checkpoint as dcp

    with single_process_dcp():
        dcp.load(dest, storage_reader=dcp.FileSystemReader(path), process_group=process_group)
    return dest


def torch_save(state: dict, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "state.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: str) -> dict:
    return torch.load(os.path.join(path, "state.pt"), weights_only=True)


def safetensors_save(state: dict, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    fsync_tree(path)


def safetensors_load(path: str) -> dict:
    """``load_file`` maps the file lazily; touching one byte per page makes the
    tensors really readable, as a training step would, so the time compares."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, "model.safetensors"))
    for t in state.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    return state


def hf_hub_save(state: dict, path: str) -> None:
    from huggingface_hub import save_torch_state_dict

    os.makedirs(path, exist_ok=True)
    save_torch_state_dict(state, path)
    fsync_tree(path)


def raw_write(state: dict, path: str) -> None:
    """The limit: the same tensor bytes written to one file and fsync'd."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "raw.bin"), "wb", buffering=0) as f:
        for t in state.values():
            view = byte_view(t.contiguous())
            for start in range(0, len(view), 16 << 20):
                f.write(view[start : start + (16 << 20)])
        os.fsync(f.fileno())


_DIRECT_BLOCK_BYTES, _DIRECT_IN_FLIGHT = 16 << 20, 4


@functools.lru_cache(maxsize=1)
def _direct_blocks() -> list[mmap.mmap]:
    blocks = [mmap.mmap(-1, _DIRECT_BLOCK_BYTES) for _ in range(_DIRECT_IN_FLIGHT)]
    for block in blocks:
        block.write(os.urandom(4096) * (_DIRECT_BLOCK_BYTES // 4096))  # touched once, untimed afterwards
    return blocks


def direct_io_works(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (not on every file system)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, ".o_direct_probe")
    os.makedirs(directory, exist_ok=True)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(probe)


def raw_direct_write(state: dict, path: str) -> None:
    """The disk's limit: as many bytes written with O_DIRECT from ready aligned memory, then fsync.

    No copy at all (the blocks are prepared once), four 16 MiB writes in flight:
    what the disk takes when nothing else is in the way.
    """
    total = sum(t.numel() * t.element_size() for t in state.values())
    blocks = _direct_blocks()
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        offsets = range(0, -(-total // _DIRECT_BLOCK_BYTES) * _DIRECT_BLOCK_BYTES, _DIRECT_BLOCK_BYTES)
        with ThreadPoolExecutor(_DIRECT_IN_FLIGHT) as pool:
            list(pool.map(lambda i: os.pwrite(fd, blocks[i % len(blocks)], offsets[i]), range(len(offsets))))
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(template: dict, path: str) -> dict:
    """The limit: the same bytes read from the page cache into fresh tensors."""
    return raw_read_into({name: torch.empty_like(t) for name, t in template.items()}, path)


def raw_read_into(dest: dict, path: str) -> dict:
    """The limit of an in-place load: the same bytes read from the page cache into existing tensors."""
    with open(os.path.join(path, "raw.bin"), "rb", buffering=0) as f:
        for t in dest.values():
            view = byte_view(t)
            done = 0
            while done < len(view):
                done += f.readinto(view[done:])
    return dest


def copy_once(state: dict, into: dict) -> None:
    """The limit of an async save's blocking part: one copy of the state into memory already allocated."""
    for name, tensor in state.items():
        into[name].copy_(tensor)

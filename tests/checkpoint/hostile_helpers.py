"""Build a small checkpoint, damage its files, and run a reader in a guarded child.

``guarded(fn)`` forks: the child resets its peak resident memory (writing 5 to
/proc/self/clear_refs sets VmHWM to the current VmRSS), calls ``fn``, and
reports what it raised and how far its peak resident memory grew over its
resident memory before the call (VmHWM - VmRSS, in bytes). The parent kills a
child that runs past ``timeout_s`` (a hang) and reports that.

Why this way of measuring memory: VmHWM counts every page the process really
touched, whoever allocated it (torch, Python objects, bytearrays, numpy), so
a memory bomb cannot hide in an allocator we did not hook; resetting it in a
fresh child makes the measurement independent of what earlier tests left in
the parent. Allocations that are reserved but never touched (a failed 4 TiB
``torch.empty``) do not count, which is right: they cost nothing. A fork per
call also isolates a crash or a hang from the test process.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import struct
import time
from dataclasses import dataclass

import torch

from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    load_consolidated,
    load_distributed,
    load_region,
    read_metadata,
    reshard,
    validate_distributed,
)
from shardkit.errors import ShardkitError
from shardkit.storage import BlockHasher

TYPED = (ShardkitError,)


@dataclass
class Outcome:
    error: str | None          # exception class name, None when fn returned
    typed: bool                # the exception is a ShardkitError
    message: str
    peak_growth_bytes: int
    value: object = None       # what fn returned, when it pickles
    hung: bool = False


def save_small(directory) -> None:
    """Two ranks: model.w [4, 3] sharded on dim 0, model.b replicated, a plain leaf ``step``; format version 1
    (``ckpt_helpers.save_v1``: these tests edit its fields and rank manifests)."""
    from ckpt_helpers import save_v1

    spec = ShardMetadata(2, {"model.w": TensorShardSpec((4, 3), 0, (2, 2))})
    for rank in range(2):
        state = {"model": {"w": torch.arange(6.0).reshape(2, 3) + rank * 6, "b": torch.ones(2)}, "step": 3}
        save_v1(state, directory, rank, 2, spec)


def read_json(path):
    return json.loads(open(path, "rb").read())


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def read_safetensors(path) -> tuple[dict, bytes]:
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors_raw(path, header_text: bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_text)) + header_text + data)


def refresh_record(directory, rank: int, *, block_bytes: int = 8 << 20) -> None:
    """Rewrite the record of ``rank_<rank>.safetensors`` (wherever it is kept) to match the file now."""
    name = f"rank_{rank}.safetensors"
    hasher = BlockHasher(block_bytes)
    hasher.update(open(os.path.join(directory, name), "rb").read())
    record = hasher.finish().to_json()
    for manifest in ("metadata.json", f"rank_{rank}.json"):
        path = os.path.join(directory, manifest)
        obj = read_json(path)
        if name in obj.get("files", {}):
            obj["files"][name] = record
            write_json(path, obj)


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _child(fn, write_fd: int) -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _vm("VmRSS")
        error, typed, message, value = None, False, "", None
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which judges it
            error, typed, message = type(e).__name__, isinstance(e, TYPED), str(e)[:2000]
        growth = max(0, _vm("VmHWM") - base)
        try:
            payload = pickle.dumps(Outcome(error, typed, message, growth, value))
        except Exception:
            payload = pickle.dumps(Outcome(error, typed, message, growth, None))
        os.write(write_fd, struct.pack("<Q", len(payload)))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
    finally:
        os._exit(0)


def guarded(fn, *, timeout_s: float = 60.0) -> Outcome:
    """Run ``fn()`` in a forked child; its outcome, peak memory growth, or ``hung=True``."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, write_fd)
    os.close(write_fd)
    try:
        data = _read_all(read_fd, time.monotonic() + timeout_s)
    finally:
        os.close(read_fd)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if data is None:
        return Outcome("hang", False, f"still running after {timeout_s} s", 0, hung=True)
    if len(data) < 8:
        return Outcome("crash", False, "the child died without reporting", 0)
    return pickle.loads(data[8:])


def _read_all(fd: int, deadline: float) -> bytes | None:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _out_state():
    return {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, "step": 0}


#: Every reader of a distributed checkpoint, by name: each takes the directory.
READERS = {
    "read_metadata": lambda d: read_metadata(d),
    "load_distributed(0 of 2)": lambda d: load_distributed(d, 0, 2),
    "load_distributed(1 of 2)": lambda d: load_distributed(d, 1, 2),
    "load_distributed(0 of 1)": lambda d: load_distributed(d, 0, 1),
    "load_distributed(verify)": lambda d: load_distributed(d, 1, 2, verify=True),
    "load_distributed(out=)": lambda d: load_distributed(d, 0, 2, out=_out_state()),
    "load_region": lambda d: load_region(d, "model.w", (1, 0), (2, 3)),
    "load_consolidated": lambda d: load_consolidated(d),
    "reshard": lambda d: reshard(d, 2, 3, 2),
}


def run_readers(directory) -> dict:
    """In the calling process: each reader's outcome ``(error name or None, typed, message)``, and validate's problems."""
    results = {}
    for name, reader in READERS.items():
        try:
            reader(directory)
            results[name] = (None, True, "")
        except TYPED as e:
            results[name] = (type(e).__name__, True, str(e))
        except Exception as e:  # noqa: BLE001 - the caller asserts there is none
            results[name] = (type(e).__name__, False, repr(e)[:500])
    try:
        results["validate"] = (None, True, validate_distributed(directory).problems)
    except Exception as e:  # noqa: BLE001
        results["validate"] = (type(e).__name__, False, repr(e)[:500])
    return results


def untyped(results: dict) -> dict:
    """The readers that raised something outside the shardkit error tree."""
    return {name: r for name, r in results.items() if not r[1]}

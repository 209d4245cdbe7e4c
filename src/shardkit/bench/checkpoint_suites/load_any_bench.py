"""``checkpoint.load`` from other formats, side by side with ``dcp.load`` (issue 30's two load rows).

- ``hf``: a bf16 Hugging Face checkpoint (4 safetensors files + index) into a
  fp32 DTensor state on 4 ranks: ``ckpt.load(..., cast=True)`` against
  ``dcp.load`` with ``HuggingFaceStorageReader``; also the bytes each rank
  requests (against its share), its peak memory above its baseline, and a
  floor: writing each rank's fresh fp32 shard once (``zero_``), which any
  load into fresh memory does (the kernel faults and zeroes every page);
- ``dcp``: a DCP checkpoint saved by 4 ranks, loaded on 3 ranks into fresh
  tensors: ``ckpt.load`` against ``dcp.load`` of the same directory.

Ranks are real processes (Gloo, one torch thread each). The destination of
every call is a fresh state of DTensors (``Shard(0)`` on a 1-D mesh, the
layout ``fully_shard`` gives each parameter; scalars plain), allocated
untimed the same way for every implementation. Implementations alternate
call by call (the order reverses every other repetition); a call starts
and ends with a barrier, so its time is the slowest rank's. The first call
of each implementation is reported apart, and the median, min and max are
of the calls after it. The loaded bytes are compared between
implementations (every call's digest against shardkit's first). Files are
in the page cache (written just before); this is not a cold-read figure.

Example::

    rows = run_load_any_benchmarks(512 << 20, 7, "/tmp/w")       # or: shardkit bench --only load-any
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import time
import zlib

import torch

from shardkit.bench.common import peak_rss, reset_peak_rss, row, with_env
from shardkit.bench.workload import make_tensor, tensor_shapes
from shardkit.launch import run_local_ranks

__all__ = ["run_load_any_benchmarks", "write_hf_checkpoint"]

HF_FILES = 4


def write_hf_checkpoint(shapes: dict, path: str, files: int = HF_FILES) -> int:
    """A bf16 safetensors checkpoint of ``shapes`` in ``files`` files (about equal bytes) + its index; its bytes."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    total = sum(_numel(s) * 2 for s in shapes.values())
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    weight_map, before = {}, 0
    for name, shape in shapes.items():   # in order, each file about total / files bytes
        weight_map[name] = names[min(files - 1, before * files // max(1, total))]
        before += _numel(shape) * 2
    for file_name in names:
        save_file({n: make_tensor(n, shapes[n], torch.bfloat16) for n, f in weight_map.items() if f == file_name},
                  os.path.join(path, file_name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- in the rank processes ------------------------------------------------------------------------

def _fresh_state(shapes: dict, mesh, dtype: torch.dtype) -> dict:
    """Fresh (untouched) destinations: a Shard(0) DTensor per tensor of >= 1 dim, a plain tensor per scalar."""
    from torch.distributed.tensor import Shard, empty

    return {n: empty(s, device_mesh=mesh, placements=[Shard(0)], dtype=dtype) if len(s) else torch.empty(s, dtype=dtype)
            for n, s in shapes.items()}


def _locals(state: dict) -> list[torch.Tensor]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in state.values()]


def _digest(state: dict) -> list[str]:
    import xxhash

    from shardkit.storage import byte_view

    return [xxhash.xxh3_64_hexdigest(byte_view(t.contiguous())) for t in _locals(state)]


def _interleaved_calls(impls: dict, fresh, reps: int) -> dict:
    """Each impl ``reps`` times, alternating; per impl: times, peak bytes above the pre-call RSS, digests."""
    import torch.distributed as dist

    out = {name: {"times": [], "peaks": [], "digests": []} for name in impls}
    for rep in range(reps):
        for name, fn in (list(impls.items())[::-1] if rep % 2 else impls.items()):
            state = fresh()
            gc.collect()
            baseline = reset_peak_rss()
            dist.barrier()
            start = time.perf_counter()
            fn(state)
            dist.barrier()
            out[name]["times"].append(time.perf_counter() - start)
            out[name]["peaks"].append(max(0, peak_rss() - baseline))
            out[name]["digests"].append(_digest(state))
            del state
    return out


@contextlib.contextmanager
def _counting_reads():
    """Count the bytes every local reader opened meanwhile is asked for (``read_into``; maps pass uncounted)."""
    from shardkit.storage import LocalStorage

    original = LocalStorage.open_reader
    counted = []

    def open_reader(self, path):
        reader = original(self, path)
        inner = reader.read_into

        def read_into(offset, out):
            counted.append(memoryview(out).nbytes)
            inner(offset, out)

        reader.read_into = read_into
        return reader

    LocalStorage.open_reader = open_reader
    try:
        yield counted
    finally:
        LocalStorage.open_reader = original


def _hf_rank(rank, world_size, path, shapes, reps):
    """HF bf16 -> fp32 DTensors: ckpt.load(cast=True) and dcp.load(HuggingFaceStorageReader), interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint as ckpt

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    fresh = lambda: _fresh_state(shapes, mesh, torch.float32)  # noqa: E731
    impls = {"shardkit": lambda st: ckpt.load(st, path, cast=True),
             "dcp": lambda st: dcp.load(st, storage_reader=dcp.HuggingFaceStorageReader(path)),
             "floor": _write_once}
    result = _interleaved_calls(impls, fresh, reps)
    state = fresh()
    with _counting_reads() as counted:
        ckpt.load(state, path, cast=True)
    result["requested"] = sum(counted)
    result["share"] = sum(t.numel() * 2 for t in _locals(state))      # bf16 bytes of this rank's boxes
    result["shard"] = sum(t.numel() * t.element_size() for t in _locals(state))
    return result


def _write_once(state: dict) -> None:
    """The least any load into fresh memory does: write every byte of the rank's shard once (``zero_``)."""
    for t in _locals(state):
        t.zero_()


def _dcp_save_rank(rank, world_size, path, shapes):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    state = _fresh_state(shapes, mesh, torch.float32)
    for name, t in state.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
        local.copy_(torch.randn(local.shape, generator=gen))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    return True


def _dcp_rank(rank, world_size, path, shapes, reps):
    """A DCP saved on 4 ranks, loaded here on ``world_size``: ckpt.load and dcp.load, interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint as ckpt

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    fresh = lambda: _fresh_state(shapes, mesh, torch.float32)  # noqa: E731
    impls = {"shardkit": lambda st: ckpt.load(st, path),
             "dcp": lambda st: dcp.load(st, storage_reader=dcp.FileSystemReader(path))}
    result = _interleaved_calls(impls, fresh, reps)
    result["shard"] = sum(t.numel() * t.element_size() for t in _locals(fresh()))
    return result


# -- in the parent ---------------------------------------------------------------------------------

def _timing(per_rank: list[dict], impl: str) -> dict:
    """First call apart; median/min/max of the others (each call: its slowest rank)."""
    slowest = [max(ts) for ts in zip(*(r[impl]["times"] for r in per_rank))]
    rest = slowest[1:] or slowest
    return {"median_s": statistics.median(rest), "min_s": min(rest), "max_s": max(rest), "first_s": slowest[0],
            "calls": len(slowest)}


def _same_bytes(per_rank: list[dict], impls: tuple[str, ...]) -> bool:
    """Every call of every impl loaded, on every rank, the bytes shardkit's first call loaded."""
    for r in per_rank:
        ref = r["shardkit"]["digests"][0]
        if any(d != ref for impl in impls for d in r[impl]["digests"]):
            return False
    return True


def _run_ranks(fn, world_size, *args, workdir):
    """``fn`` on ranks whose freed large buffers go back to the OS at once (peak RSS = what a call holds)."""
    return with_env({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}, run_local_ranks, fn, world_size, *args,
                     workdir=workdir)


def hf_rows(size_bytes: int, reps: int, workdir: str, world_size: int = 4) -> list[dict]:
    shapes = tensor_shapes(size_bytes, torch.bfloat16)
    path = os.path.join(workdir, "load-any-hf")
    total = write_hf_checkpoint(shapes, path)
    try:
        res = _run_ranks(_hf_rank, world_size, path, shapes, reps, workdir=workdir)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    case = f"hf bf16 -> fp32 DTensor, {world_size} ranks"
    same = _same_bytes(res, ("shardkit", "dcp"))
    worst = max(res, key=lambda r: max(r["shardkit"]["peaks"]) - 1.2 * r["shard"])
    requested = max(res, key=lambda r: r["requested"] / max(1, r["share"]))
    note = (f"{HF_FILES} files; equal bytes: {same}; requested/share (worst rank, headers included) "
            f"{requested['requested'] / max(1, requested['share']):.3f}; shard {worst['shard'] >> 20} MiB")
    return [row(case, "shardkit", _timing(res, "shardkit"), bytes=total, note=note,
                peak_bytes=max(worst["shardkit"]["peaks"]), out_bytes=worst["shard"], same_bytes=same,
                requested_bytes=[r["requested"] for r in res], share_bytes=[r["share"] for r in res]),
            row(case, "dcp.load(HuggingFaceStorageReader)", _timing(res, "dcp"), bytes=total,
                peak_bytes=max(worst["dcp"]["peaks"]), out_bytes=worst["shard"]),
            row(case, "write the fresh fp32 shard once (floor)", _timing(res, "floor"), kind="limit",
                peak_bytes=max(worst["floor"]["peaks"]), out_bytes=worst["shard"])]


def dcp_rows(size_bytes: int, reps: int, workdir: str, saved_world: int = 4, world_size: int = 3) -> list[dict]:
    shapes = tensor_shapes(size_bytes, torch.float32)
    path = os.path.join(workdir, "load-any-dcp")
    run_local_ranks(_dcp_save_rank, saved_world, path, shapes, workdir=workdir)
    total = sum(_numel(s) * 4 for s in shapes.values())
    try:
        res = _run_ranks(_dcp_rank, world_size, path, shapes, reps, workdir=workdir)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    case = f"dcp {saved_world} ranks -> {world_size} ranks, fp32"
    same = _same_bytes(res, ("shardkit", "dcp"))
    worst = max(res, key=lambda r: max(r["shardkit"]["peaks"]))
    return [row(case, "shardkit", _timing(res, "shardkit"), bytes=total, note=f"equal bytes: {same}",
                peak_bytes=max(worst["shardkit"]["peaks"]), out_bytes=worst["shard"], same_bytes=same),
            row(case, "torch.distributed.checkpoint.load", _timing(res, "dcp"), bytes=total,
                peak_bytes=max(worst["dcp"]["peaks"]), out_bytes=worst["shard"])]


def run_load_any_benchmarks(size_bytes: int, reps: int, workdir: str, cases=("hf", "dcp")) -> list[dict]:
    """The rows of :mod:`shardkit.bench.checkpoint_suites.load_any_bench` (``cases``: ``hf``, ``dcp``); at least 3 calls each."""
    reps = max(3, reps)
    rows: list[dict] = []
    if "hf" in cases:
        rows += hf_rows(size_bytes, reps, workdir)
    if "dcp" in cases:
        rows += dcp_rows(size_bytes, reps, workdir)
    return rows

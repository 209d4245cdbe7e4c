"""``shardkit bench --only incremental``: incremental saves (``save(..., base=)``) against full ones.

The state is 64 float32 tensors of ``size / 64`` bytes each (1 GiB: 16 MiB
each). Three rows, each fsync'd, interleaved with its full-save peer:

- **4.7% changed**: 3 of the 64 tensors differ from the base (3/64 = 4.69%);
  the incremental save compares the other 61 with the base file (byte for
  byte) and writes 3. Two bases: one read back into the page cache before each
  run ("base cached": what a base that was read or written buffered has),
  and one evicted before each run ("base on disk": what a base written with
  ``O_DIRECT`` has, shardkit's own saves included).
- **everything changed**: every tensor differs; the incremental save gives
  up on each after its first 64 KiB and writes everything.
- **load the 20th step of a chain** (``checkpoint.load`` in place, warm
  cache) against the same state saved in full: each step of the chain
  changes the same 3 tensors (an adapter: step 20 reads from 2 directories),
  or 3 other tensors (step 20 reads from 21 directories).

The notes give the bytes each save wrote against the bytes that changed.
What it does not measure: multi-rank saves, object stores, row-band changes
in one huge tensor (a chunk is written whole or referenced whole).
"""

from __future__ import annotations

import os
import shutil

import torch

import shardkit.checkpoint as ck
from shardkit.bench.common import evict_files, row, time_interleaved, warm_files
from shardkit.checkpoint.format.manifest import read_manifest
from shardkit.storage import storage_for

__all__ = ["run_incremental_benchmarks", "TENSORS", "CHANGED"]

TENSORS = 64
CHANGED = 3
CHAIN_STEPS = 20


def _state(size_bytes: int) -> dict[str, torch.Tensor]:
    per = max(1, size_bytes // TENSORS // 4)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.w": torch.randn(per, generator=g) for i in range(TENSORS)}


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _written_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n.endswith(".safetensors"))


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()   # nothing left dirty by an earlier run is charged to this one


def _bump(state, names) -> None:
    for n in names:
        state[n].add_(1.0)


def bench_changed(state, workdir: str, reps: int, changed: list[str], case: str) -> list[dict]:
    """A full save against incremental saves of the same state, ``changed`` differing from the base."""
    base = os.path.join(workdir, "inc-base")
    _fresh(base)
    ck.save(state, base)
    out = os.path.join(workdir, "inc-out")
    written: dict[str, int] = {}
    impls = {
        "shardkit": lambda: ck.save(state, out, base=base),
        "shardkit, base on disk (evicted)": lambda: ck.save(state, out, base=base),
        "full save (no base)": lambda: ck.save(state, out),
    }

    def setup(name):
        _fresh(out)
        _bump(state, changed)            # differ from the base (and from the last run)
        if name == "shardkit, base on disk (evicted)":
            evict_files(base)
        elif name == "shardkit":
            warm_files(base)

    timings = time_interleaved(impls, reps, setup)
    for name, fn in impls.items():   # once more, untimed, to count what each wrote
        setup(name)
        fn()
        written[name] = _written_bytes(out)
    changed_bytes = sum(state[n].numel() * state[n].element_size() for n in changed)
    _fresh(out)
    _fresh(base)
    nbytes = _nbytes(state)
    return [row(case, name, timing, bytes=nbytes, bytes_written=written[name], changed_bytes=changed_bytes,
                note=f"wrote {written[name] / 2**20:.1f} MiB = {written[name] / max(1, changed_bytes):.3f}x "
                     f"the {changed_bytes / 2**20:.1f} MiB changed")
            for name, timing in timings.items()]


def bench_chain_load(state, workdir: str, reps: int, *, scattered: bool) -> list[dict]:
    """``checkpoint.load`` (in place, warm cache) of step 20 of a chain against the same state saved in full.

    ``scattered``: each step changes 3 other tensors (step 20 reads from 21 directories); else the same
    3 every step (an adapter: step 20 reads from itself and step 0)."""
    names = sorted(state)
    root = os.path.join(workdir, "inc-chain")
    _fresh(root)
    for step in range(CHAIN_STEPS + 1):
        if step:
            first = CHANGED * step if scattered else 0
            _bump(state, [names[(first + i) % len(names)] for i in range(CHANGED)])
        ck.save(state, os.path.join(root, f"step-{step}"),
                base=os.path.join(root, f"step-{step - 1}") if step else None)
    last = os.path.join(root, f"step-{CHAIN_STEPS}")
    full = os.path.join(workdir, "inc-full")
    _fresh(full)
    ck.save(state, full)
    out = {n: torch.empty_like(t) for n, t in state.items()}
    ck.load(out, last)
    assert all(torch.equal(out[n], state[n]) for n in names), "the chain loaded other values"
    warm_files(root, full)
    timings = time_interleaved({"shardkit": lambda: ck.load(out, last), "full checkpoint": lambda: ck.load(out, full)},
                               reps)
    bases = len(read_manifest(*storage_for(last)).bases)
    _fresh(root)
    _fresh(full)
    what = "3 other tensors per step" if scattered else "the same 3 tensors per step"
    return [row(f"load step {CHAIN_STEPS} of a chain, {what}", name, timing, bytes=_nbytes(state),
                note=(f"references {bases} earlier steps" if name == "shardkit" else "version 2, self-contained"))
            for name, timing in timings.items()]


def run_incremental_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    state = _state(size_bytes)
    names = sorted(state)
    rows = bench_changed(state, workdir, reps, names[:CHANGED],
                         f"save, {100 * CHANGED / TENSORS:.1f}% changed, fsync'd")
    rows += bench_changed(state, workdir, reps, names, "save, everything changed, fsync'd")
    rows += bench_chain_load(state, workdir, reps, scattered=False)
    rows += bench_chain_load(state, workdir, reps, scattered=True)
    return rows

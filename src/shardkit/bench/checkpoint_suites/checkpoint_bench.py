"""Single-rank checkpoint rows: save (fsync'd), warm load, async save.

Every implementation runs on the same state, one after the other, in this
process; each repetition writes to a fresh directory (removed, untimed,
before the next) so no run gains from another's files.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch

from shardkit.bench import peers
from shardkit.bench.checkpoint_suites.async_first import DCP_ASYNC, IMPLS as FIRST_CALL_IMPLS, first_call_blocked
from shardkit.bench.common import FIRST_CALL_MIN_REPS, NOISY_MIN_REPS, VERIFY_MIN_REPS, row, time_interleaved, warm_files
from shardkit.bench.workload import make_state, state_bytes
from shardkit.checkpoint import AsyncCheckpointer, ShardMetadata, load_distributed, save_distributed

SINGLE = ShardMetadata(num_ranks=1, tensor_specs={})


def _save_impls(state, workdir: str):
    impls = {
        "shardkit": lambda p: save_distributed(state, p, 0, 1, SINGLE),
        "torch.distributed.checkpoint.save": lambda p: peers.dcp_save(state, p),
        "torch.save + fsync": lambda p: peers.torch_save(state, p),
        "safetensors.save_file + fsync": lambda p: peers.safetensors_save(state, p),
        "huggingface_hub.save_torch_state_dict + fsync": lambda p: peers.hf_hub_save(state, p),
        "raw write + fsync (limit)": lambda p: peers.raw_write(state, p),
    }
    if peers.direct_io_works(workdir):
        impls["O_DIRECT write of as many bytes, 4 x 16 MiB in flight (disk limit)"] = (
            lambda p: peers.raw_direct_write(state, p))
    return impls


def bench_save(state, workdir: str, reps: int) -> list[dict]:
    nbytes, path = state_bytes(state), os.path.join(workdir, "save")
    impls = _save_impls(state, workdir)

    def fresh(_name):
        shutil.rmtree(path, ignore_errors=True)
        os.sync()  # nothing left dirty by an earlier run is charged to this one

    timings = time_interleaved({impl: (lambda save=save: save(path)) for impl, save in impls.items()}, reps, fresh)
    shutil.rmtree(path, ignore_errors=True)
    return [row("save, 1 rank, fsync'd", impl, timing, kind="limit" if "limit" in impl else "peer", bytes=nbytes)
            for impl, timing in timings.items()]


def _warm_loads(case: str, cases: dict, workdir: str, reps: int, nbytes: int) -> list[dict]:
    """Each impl ``(subdir, save, load[, note])`` loads its own files, written once, then loaded once
    untimed (the load also checks the impl works) and read once sequentially (:func:`warm_files`:
    warm cache, the same page-cache state for every impl); timed runs interleaved."""
    loads, paths, notes = {}, [], {}
    for impl, (sub, save, load, *note) in cases.items():
        path = os.path.join(workdir, sub)
        paths.append(path)
        shutil.rmtree(path, ignore_errors=True)
        save(path)
        load(path)
        loads[impl] = (lambda load=load, path=path: load(path))
        notes[impl] = note[0] if note else None
    warm_files(*paths)
    timings = time_interleaved(loads, reps)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return [row(case, impl, timing, kind="limit" if "limit" in impl else "peer", bytes=nbytes,
                **({"note": notes[impl]} if notes[impl] else {}))
            for impl, timing in timings.items()]


def _save_ours(state):
    return lambda p: save_distributed(state, p, 0, 1, SINGLE)


def bench_load(state, workdir: str, reps: int) -> list[dict]:
    """A fresh load: every impl allocates (or maps) its own outputs inside the timed call, warm cache, interleaved.

    ``shardkit`` (the default) returns tensors over copy-on-write maps of the
    files, every block hashed from the mapped pages before it returns
    (:func:`bench_verify_mapped` compares that with ``verify=False``);
    ``+ pages touched`` reads one element per page, as a first training
    step would; ``verify=True`` copies and hashes every byte. ``dcp.load`` is given tensors allocated inside the
    timed call (DCP loads in place), reads each one from its file into them,
    paying a page fault per fresh page. ``load_file`` maps, like shardkit.
    """
    return _warm_loads("load, 1 rank, fresh, warm cache", {
        "shardkit": ("load-shardkit", _save_ours(state), lambda p: load_distributed(p, 0, 1),
                     "default: zero-copy map, verified"),
        "shardkit + pages touched": ("load-shardkit-touch", _save_ours(state),
                                     lambda p: _touch(load_distributed(p, 0, 1)),
                                     "map (verified), then one read per page"),
        "shardkit verify=True": ("load-shardkit-copy", _save_ours(state),
                                 lambda p: load_distributed(p, 0, 1, verify=True), "copies into fresh memory, hashes"),
        "torch.distributed.checkpoint.load": ("load-dcp", lambda p: peers.dcp_save(state, p),
                                              lambda p: peers.dcp_load(state, p),
                                              "empty_like inside the call, then filled"),
        "torch.load(weights_only=True)": ("load-pt", lambda p: peers.torch_save(state, p), peers.torch_load),
        "safetensors.load_file (mmap, pages touched)": ("load-st", lambda p: peers.safetensors_save(state, p),
                                                        peers.safetensors_load),
        "read from page cache, 1 thread (limit)": ("load-raw", lambda p: peers.raw_write(state, p),
                                                   lambda p: peers.raw_read(state, p), "into fresh memory"),
    }, workdir, reps, state_bytes(state))


def _touch(tree) -> None:
    """Read one element per page of every tensor in a (nested) state."""
    if isinstance(tree, dict):
        for value in tree.values():
            _touch(value)
    elif isinstance(tree, torch.Tensor) and tree.numel():
        tree.reshape(-1)[:: max(1, 4096 // tree.element_size())].sum()


def bench_verify(state, workdir: str, reps: int) -> list[dict]:
    """A copying load (``knobs.MAP_LOADS`` off) with and without hashing every block, interleaved.

    The figure the issue's "verified load <= 1.1x unverified" is about: the
    hash runs in the copy loop while the bytes are hot. ``shardkit`` is the
    default (verified); the ratio printed for ``verify=False`` is its time
    over the verified one's (>= 0.91 meets the 1.1x bound). Runs at least
    ``common.VERIFY_MIN_REPS`` times whatever ``reps`` says: a load into fresh memory
    swings by +-30% on the 2-core VM with how fast it hands out pages, far
    more than the hash costs, and a median of 3 does not settle the ratio.
    """
    from shardkit import knobs

    path = os.path.join(workdir, "verify")
    shutil.rmtree(path, ignore_errors=True)
    save_distributed(state, path, 0, 1, SINGLE)
    warm_files(path)
    saved, knobs.MAP_LOADS = knobs.MAP_LOADS, False
    try:
        load_distributed(path, 0, 1, verify=False)  # untimed: the code paths and the allocator warm
        timings = time_interleaved({
            "shardkit": lambda: load_distributed(path, 0, 1, verify=True),
            "shardkit verify=False": lambda: load_distributed(path, 0, 1, verify=False),
        }, max(reps, VERIFY_MIN_REPS))
    finally:
        knobs.MAP_LOADS = saved
        shutil.rmtree(path, ignore_errors=True)
    notes = {"shardkit": "copying load, verified (the default)", "shardkit verify=False": "copying load, no hashing"}
    return [row("load: verified vs not (copies), warm cache", impl, timing, bytes=state_bytes(state), note=notes[impl])
            for impl, timing in timings.items()]


def bench_verify_mapped(state, workdir: str, reps: int) -> list[dict]:
    """A fresh zero-copy load with every page touched: verified (the default) vs not vs ``dcp.load``, interleaved.

    ``shardkit`` maps the file and hashes every block from the mapped pages
    before it returns (``storage.safetensors_format.tensor_io.map_verified``), then one element
    per page is read; ``shardkit verify=False`` is the same load unhashed
    (its pages faulted by the touches); ``dcp.load`` fills tensors allocated
    inside the call (then touched alike). ``one xxh3 pass`` hashes the same
    bytes, already in memory, in the same blocks on the same I/O threads:
    what the verified load's extra time is measured against. Each impl's
    first call in this process is kept (``first_s``) apart from the
    interleaved runs (at least ``common.VERIFY_MIN_REPS``).
    """
    ours, dcp_path = os.path.join(workdir, "mapped-verified"), os.path.join(workdir, "mapped-verified-dcp")
    for path in (ours, dcp_path):
        shutil.rmtree(path, ignore_errors=True)
    save_distributed(state, ours, 0, 1, SINGLE)
    peers.dcp_save(state, dcp_path)
    warm_files(ours, dcp_path)
    runs: dict[str, list[float]] = {}
    impls = {name: _recorded(runs, name, fn) for name, fn in {
        "shardkit": lambda: _touch(load_distributed(ours, 0, 1)),
        "shardkit verify=False": lambda: _touch(load_distributed(ours, 0, 1, verify=False)),
        "torch.distributed.checkpoint.load": lambda: _touch(peers.dcp_load(state, dcp_path)),
        XXH3_PASS: _xxh3_pass(state),
    }.items()}
    first = {name: time_interleaved({name: fn}, 1)[name]["median_s"] for name, fn in impls.items()}
    runs.clear()
    timings = time_interleaved(impls, max(reps, VERIFY_MIN_REPS))
    for path in (ours, dcp_path):
        shutil.rmtree(path, ignore_errors=True)
    notes = {"shardkit": "mapped, every block hashed before it returns, then one read per page",
             "shardkit verify=False": "mapped, unhashed, then one read per page",
             "torch.distributed.checkpoint.load": "empty_like inside the call, filled, then one read per page",
             XXH3_PASS: "in memory, same blocks, same I/O threads"}
    cost = _verify_cost(runs)
    return [row("load: mapped + touched, verified vs not", impl, timing, bytes=state_bytes(state),
                kind="limit" if impl == XXH3_PASS else "peer", note=notes[impl], first_s=first[impl],
                runs_s=[round(t, 4) for t in runs[impl]], **(cost if impl == "shardkit" else {}))
            for impl, timing in timings.items()]


XXH3_PASS = "one xxh3 pass over the same bytes"


def _recorded(runs: dict[str, list[float]], name: str, fn):
    """``fn``, appending each call's seconds to ``runs[name]`` (for per-round pairs)."""
    def run():
        start = time.perf_counter()
        fn()
        runs.setdefault(name, []).append(time.perf_counter() - start)
    return run


def _verify_cost(runs: dict[str, list[float]]) -> dict:
    """What hashing a mapped load costs: the median per-round difference verified - unverified, and that in
    xxh3 passes over the same bytes (the median pass of the same rounds)."""
    diffs = [a - b for a, b in zip(runs["shardkit"], runs["shardkit verify=False"])]
    cost, one_pass = statistics.median(diffs), statistics.median(runs[XXH3_PASS])
    return {"verify_cost_s": cost, "verify_cost_min_s": min(diffs), "verify_cost_max_s": max(diffs),
            "xxh3_pass_s": one_pass, "verify_cost_in_xxh3_passes": cost / one_pass if one_pass > 0 else None}


def _xxh3_pass(state):
    """A job that hashes every tensor of ``state`` in checksum blocks on the I/O threads (as a verified map is)."""
    from shardkit import knobs
    from shardkit.storage import new_block_hasher, run_parallel

    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in _tensors(state) if t.numel()]
    block, job = knobs.CHECKSUM_BLOCK_BYTES, 64 << 20

    def hash_blocks(view):
        for start in range(0, len(view), block):
            hasher = new_block_hasher()
            hasher.update(view[start:start + block])
            hasher.hexdigest()

    jobs = [lambda v=v[s:s + job]: hash_blocks(v) for v in views for s in range(0, len(v), job)]
    return lambda: run_parallel(jobs)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    return [tree.contiguous()] if isinstance(tree, torch.Tensor) else []


def bench_load_into(state, workdir: str, reps: int) -> list[dict]:
    """Loads into tensors that already exist (``out=``; DCP's own in-place API), warm cache, interleaved.

    Each impl fills its own destination state, allocated here and first
    touched by the untimed warm-up read, as a training job's model and
    optimizer already are. ``shardkit verify=False`` is the same load without
    hashing: what verification (on by default) costs where no page fault hides it.
    """
    def dest():
        return {k: torch.zeros_like(v) for k, v in state.items()}

    shardkit_out, unverified_out, dcp_out, raw_out = dest(), dest(), dest(), dest()
    return _warm_loads("load in place (out=), warm cache", {
        "shardkit": ("into-shardkit", _save_ours(state), lambda p: load_distributed(p, 0, 1, out=shardkit_out)),
        "shardkit verify=False": ("into-shardkit-unverified", _save_ours(state),
                                  lambda p: load_distributed(p, 0, 1, out=unverified_out, verify=False),
                                  "in place, no hashing"),
        "torch.distributed.checkpoint.load": ("into-dcp", lambda p: peers.dcp_save(state, p),
                                              lambda p: peers.dcp_load_into(dcp_out, p)),
        "read from page cache into them, 1 thread (limit)": ("into-raw", lambda p: peers.raw_write(state, p),
                                                              lambda p: peers.raw_read_into(raw_out, p)),
    }, workdir, max(reps, VERIFY_MIN_REPS), state_bytes(state))


def bench_async(state, workdir: str, reps: int, size_bytes: int | None = None) -> list[dict]:
    """Time the caller is blocked by a background save: the first call, and the steady state.

    ``async first call``: each implementation's first call in a process of
    its own (``bench.checkpoint_suites.async_first``: same state, same preparation, the
    staging memory whatever a fresh process gets), shardkit's
    ``save_async`` and ``dcp.async_save`` alternating, one child per run.
    Each row keeps every child's time (``runs_s``), and shardkit's rows the
    median of the per-round ratios to DCP's child (``paired_ratio_to_dcp``).
    Three shardkit rows: the default; without its prefault helpers; and a
    checkpointer that was given the state at construction with
    ``prepare(state, background=True)`` (its buffers made on a thread during
    the child's settle, as during a job's first training steps).
    ``size_bytes`` is the size the state was made for (the children rebuild
    it); None skips this case.

    ``async steady: caller blocked``: ``shardkit`` is a training loop's
    steady state: its staging buffers were allocated by ``prepare()``
    (untimed) and every save reuses them; beside it a synchronous
    ``save_distributed`` of the same state, ``dcp.async_save`` called again
    in this process (it stages into new memory each call) and one copy of
    the state into allocated memory. Before each timed call the previous
    background save is waited for and the disk synced (untimed), so no save
    runs behind another's measurement; all interleaved.
    """
    rows = []
    if size_bytes is not None:
        rows += _bench_async_first(size_bytes, workdir, reps)
    return rows + _bench_async_steady(state, workdir, reps)


def _bench_async_first(size_bytes: int, workdir: str, reps: int) -> list[dict]:
    path = os.path.join(workdir, "async-first")
    times: dict[str, list[float]] = {impl: [] for impl in FIRST_CALL_IMPLS}
    for rep in range(max(reps, FIRST_CALL_MIN_REPS)):
        for impl in (list(FIRST_CALL_IMPLS)[::-1] if rep % 2 else list(FIRST_CALL_IMPLS)):
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            times[impl].append(first_call_blocked(impl, size_bytes, path))
    shutil.rmtree(path, ignore_errors=True)
    return [row("async first call: caller blocked", impl,
                {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}, bytes=size_bytes,
                runs_s=[round(t, 4) for t in ts], **_paired_to_dcp(ts, times[DCP_ASYNC]))
            for impl, ts in times.items()]


def _paired_to_dcp(ts: list[float], dcp_ts: list[float]) -> dict:
    """The median of the per-round ratios (this impl's child over DCP's child of the same round).

    The two children of a round run back to back, so a minute in which the
    VM hands out memory slowly lands on both: their ratio keeps the
    comparison, where the ratio of the two medians can flip with which
    children such a minute happened to hit.
    """
    if ts is dcp_ts:
        return {}
    return {"paired_ratio_to_dcp": statistics.median(a / b for a, b in zip(ts, dcp_ts))}


def _bench_async_steady(state, workdir: str, reps: int) -> list[dict]:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(workdir, "async")
    steady = AsyncCheckpointer(path, 0, 1, SINGLE)
    steady.prepare(state)
    copy_into = {name: torch.empty_like(t) for name, t in state.items()}
    peers.copy_once(state, copy_into)  # first touch, untimed
    pending = []

    def dcp_async_save():
        with peers.single_process_dcp():
            pending.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True)))

    impls = {
        "shardkit": lambda: pending.append(steady.save_async(state)),
        "shardkit save_distributed (sync)": lambda: save_distributed(state, path, 0, 1, SINGLE),
        "torch.distributed.checkpoint.async_save, again": dcp_async_save,
        "copy the state once into allocated memory (limit)": lambda: peers.copy_once(state, copy_into),
    }

    def drain(_name=None):
        for item in pending:
            (item.wait() if hasattr(item, "wait") else item.result())
        pending.clear()
        shutil.rmtree(path, ignore_errors=True)
        os.sync()

    timings = time_interleaved(impls, max(reps, NOISY_MIN_REPS), drain)
    drain()
    steady.close()
    return [row("async steady: caller blocked", impl, timing, kind="limit" if "limit" in impl else "peer",
                bytes=state_bytes(state))
            for impl, timing in timings.items()]


def run_checkpoint_benchmarks(size_bytes: int, reps: int, workdir: str, cases=("save", "load", "async")) -> list[dict]:
    state = make_state(size_bytes)
    rows = []
    if "save" in cases:
        rows += bench_save(state, workdir, reps)
    if "load" in cases:
        rows += bench_load(state, workdir, reps)
        rows += bench_load_into(state, workdir, reps)
        rows += bench_verify(state, workdir, reps)
        rows += bench_verify_mapped(state, workdir, reps)
    if "async" in cases:
        rows += bench_async(state, workdir, reps, size_bytes)
    return rows

"""``shardkit bench --only incremental``: incremental saves (``save(..., base=)``) against full ones.

The state is 64 float32 tensors of ``size / 64`` bytes each (1 GiB: 16 MiB
each). Three rows, each fsync'd, interleaved with its full-save peer:

- **4.7% changed**: 3 of the 64 tensors differ from the base (3/64 = 4.69%);
  the incremental save compares the other 61 with the base file (byte for
  byte) and writes 3. Two bases: one read back into the page cache before each
  run ("base cached": what a base that was read or written buffered has),
  and one evicted before each run ("base on disk": what a base written with
  ``O_DIRECT`` has, shardkit's own saves included). Beside them a **floor**
  (not an implementation, ``kind="limit"``): the least any byte-for-byte
  proof must do here, timed the same way: one ``memcmp`` pass of the 61
  unchanged tensors against a fresh map of the (cached) base file, split
  over the CPUs, while another thread writes the 3 changed tensors to a
  file with shardkit's writer (``O_DIRECT``, checksums, fsync). Its note gives it, and shardkit's cached-base
  row, as a fraction of the full save's median.
- **everything changed**: every tensor differs; the incremental save gives
  up on each after its first 64 KiB and writes everything.
- **background, 4.7% changed**: ``async_save(state, dir, base=).wait()``
  whose base is the last background save (written untimed before each run,
  with ``O_DIRECT``: on disk, not cached), against a full
  ``async_save(state, dir).wait()`` after the same preparation. The
  incremental one proves the 61 unchanged tensors against its staging
  buffers (``checkpoint.background.staged_proof``), reading no base byte.
  ``wait()`` lifts the background pace, so both write at full speed.
- **load the 20th step of a chain** (``checkpoint.load`` in place) against
  the same state saved in full: each step of the chain changes the same 3
  tensors (an adapter: step 20 reads from 2 directories), or 3 other tensors
  (step 20 reads from 21 directories). Three cache states, each the same for
  every implementation: **cold** (every file evicted before each run: a
  resume), **warm, cached by a load** (evicted, then loaded once untimed:
  the folios a first load leaves, what a second load or a validate after a
  load finds), and **warm, cached by read()** (evicted, then read
  sequentially with ``read()``). How the pages got into the cache matters
  to a mapped copy: ``read()``'s read-ahead ramps its folio size up over
  each file, so 20 files of 48 MiB are cached in smaller folios than one of
  1 GiB and fault in more pages per byte; a mapped load's own read-ahead
  does not ramp that way.

The notes give the bytes each save wrote against the bytes that changed.
What it does not measure: multi-rank saves, object stores, row-band changes
in one huge tensor (a chunk is written whole or referenced whole).
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading

import torch

import shardkit.checkpoint as ck
from shardkit.bench.common import evict_files, row, time_interleaved, warm_files
from shardkit.checkpoint.format.manifest import read_manifest
from shardkit.checkpoint.format.references import data_path
from shardkit.storage import byte_view, read_header, run_parallel, storage_for, write_safetensors
from shardkit.storage.fast_io.memcopy import buffer_address, equal_at

__all__ = ["run_incremental_benchmarks", "TENSORS", "CHANGED", "FLOOR"]

TENSORS = 64
CHANGED = 3
CHAIN_STEPS = 20
FLOOR = "floor: memcmp unchanged || write+fsync changed"


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


def floor_run(state, changed: list[str], base_file: str, begins: dict[str, int], out_file: str,
              threads: int) -> None:
    """The least a byte-for-byte proof must do (no implementation): ``memcmp`` every unchanged tensor
    against a fresh map of ``base_file`` (where ``begins[name]``, read from its header beforehand, says)
    on ``threads`` threads in even shares, while one more thread writes the ``changed`` tensors' bytes
    to ``out_file`` and fsyncs it. Raises if a compare differs."""
    with open(base_file, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    address = buffer_address(mapping)
    pieces = [(address + begins[n], t.data_ptr(), t.numel() * t.element_size())
              for n, t in state.items() if n not in changed]
    failed: list[int] = []

    def compare(share):
        failed.extend(1 for a, b, n in share if not equal_at(a, b, n))

    def write():   # the fastest durable write here: shardkit's own (O_DIRECT, block checksums, fsync)
        write_safetensors(storage_for(out_file)[0], out_file, [(n, state[n]) for n in changed])

    workers = [threading.Thread(target=write)]
    workers += [threading.Thread(target=compare, args=(s,)) for s in _shares(pieces, threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    mapping.close()
    if failed:
        raise AssertionError("the floor's compare found a difference in a tensor the base holds unchanged")


def _begins(path: str) -> dict[str, int]:
    """Where each tensor's bytes begin in the safetensors file ``path`` (its header)."""
    with storage_for(path)[0].open_reader(path) as reader:
        return {n: e.begin for n, e in read_header(reader).tensors.items()}


def _shares(pieces: list[tuple[int, int, int]], threads: int) -> list[list[tuple[int, int, int]]]:
    """``pieces`` (address, address, bytes) cut into ``threads`` runs of about equal bytes."""
    share = -(-sum(n for _, _, n in pieces) // max(1, threads))
    out: list[list] = [[]]
    room = share
    for a, b, n in pieces:
        while n > 0:
            k = min(n, room)
            out[-1].append((a, b, k))
            a, b, n, room = a + k, b + k, n - k, room - k
            if room == 0:
                out.append([])
                room = share
    return [s for s in out if s]


def bench_changed(state, workdir: str, reps: int, changed: list[str], case: str, *, floor: bool = False) -> list[dict]:
    """A full save against incremental saves of the same state, ``changed`` differing from the base
    (``floor``: and :func:`floor_run`, interleaved with them)."""
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
    if floor:
        base_file = os.path.join(base, "rank_0.safetensors")
        begins = _begins(base_file)
        impls[FLOOR] = lambda: floor_run(state, changed, base_file, begins, os.path.join(out, "floor.safetensors"),
                                         os.cpu_count() or 1)

    def setup(name):
        _fresh(out)
        if name == FLOOR:
            os.makedirs(out)
        _bump(state, changed)            # differ from the base (and from the last run)
        if name == "shardkit, base on disk (evicted)":
            evict_files(base)
        elif name in ("shardkit", FLOOR):
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
    full_s = timings["full save (no base)"]["median_s"]
    notes = {name: f"wrote {written[name] / 2**20:.1f} MiB = {written[name] / max(1, changed_bytes):.3f}x "
                   f"the {changed_bytes / 2**20:.1f} MiB changed" for name in timings}
    if floor:
        notes[FLOOR] = (f"not an implementation: the floor is {timings[FLOOR]['median_s'] / full_s:.3f}x the "
                        f"full save's median, shardkit (base cached) {timings['shardkit']['median_s'] / full_s:.3f}x")
    return [row(case, name, timing, kind="limit" if name == FLOOR else "peer", bytes=nbytes,
                bytes_written=written[name], changed_bytes=changed_bytes, note=notes[name])
            for name, timing in timings.items()]


def bench_background(state, workdir: str, reps: int, changed: list[str]) -> list[dict]:
    """A background incremental save whose base is the last background save, against a full one (see the
    module docstring); each waited for at once."""
    base, out = os.path.join(workdir, "inc-bg-base"), os.path.join(workdir, "inc-bg-out")
    impls = {"shardkit": lambda: ck.async_save(state, out, base=base).wait(),
             "full async_save (no base)": lambda: ck.async_save(state, out).wait()}

    def setup(_name):
        _fresh(out)
        _fresh(base)
        ck.async_save(state, base).wait()     # the last background save: its staging buffers are kept
        os.sync()
        _bump(state, changed)

    timings = time_interleaved(impls, reps, setup)
    setup("shardkit")
    impls["shardkit"]()
    written, changed_bytes = _written_bytes(out), sum(state[n].numel() * state[n].element_size() for n in changed)
    _fresh(out)
    _fresh(base)
    note = {"shardkit": f"wrote {written / 2**20:.1f} MiB = {written / max(1, changed_bytes):.3f}x the "
                        f"{changed_bytes / 2**20:.1f} MiB changed; read no byte of the base's data file"}
    return [row(f"background save, {100 * len(changed) / TENSORS:.1f}% changed, base = the last one, call + wait",
                name, timing, bytes=_nbytes(state), note=note.get(name, "every byte written"),
                **({"bytes_written": written, "changed_bytes": changed_bytes} if name == "shardkit" else {}))
            for name, timing in timings.items()]


def bench_chain_load(state, workdir: str, reps: int, *, scattered: bool) -> list[dict]:
    """``checkpoint.load`` (in place) of step 20 of a chain against the same state saved in full, cold and warm.

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
    impls = {"shardkit": lambda: ck.load(out, last), "full checkpoint": lambda: ck.load(out, full),
             RAW_CHAIN: lambda: raw_reads(last, out), RAW_FULL: lambda: raw_reads(full, out)}
    by_cache = {"cold": time_interleaved(impls, reps, lambda _name: evict_files(root, full))}
    evict_files(root, full)
    ck.load(out, last)
    ck.load(out, full)
    by_cache["warm, cached by a load"] = time_interleaved(impls, reps)
    warm_files(root, full)
    by_cache["warm, cached by read()"] = time_interleaved(impls, reps)
    bases = len(read_manifest(*storage_for(last)).bases)
    _fresh(root)
    _fresh(full)
    what = "3 other tensors per step" if scattered else "the same 3 tensors per step"
    notes = {"shardkit": f"references {bases} earlier steps", "full checkpoint": "self-contained"}
    return [row(f"load step {CHAIN_STEPS} of a chain, {what}, {cache}", name, timing, bytes=_nbytes(state),
                kind="limit" if name in (RAW_CHAIN, RAW_FULL) else "peer",
                note=notes.get(name, "the tensors' bytes read straight from their files: no plan, no checksum"))
            for cache, timings in by_cache.items() for name, timing in timings.items()]


#: Limits of the chain load: the same bytes read from the same files, with nothing else done.
RAW_CHAIN = "raw reads: the chain's files"
RAW_FULL = "raw reads: the full checkpoint's file"


def raw_reads(directory: str, out: dict[str, torch.Tensor]) -> None:
    """Read each tensor's bytes of the one-rank checkpoint in ``directory`` (references followed) straight
    into ``out``, one job per tensor on the I/O threads, each file opened once: what any load of it
    must do at least (how many files it reads from included), with no planning or verifying."""
    storage, root = storage_for(directory)
    m = read_manifest(storage, root)
    readers = {}
    try:
        jobs = []
        for name, t in out.items():
            chunk = m.tensors[name].chunks[0]
            if chunk.file not in readers:
                readers[chunk.file] = storage.open_reader(data_path(storage, root, chunk.file))
            reader = readers[chunk.file]
            jobs.append(lambda r=reader, b=chunk.begin, v=byte_view(t): r.read_into(b, v))
        run_parallel(jobs)
    finally:
        for reader in readers.values():
            reader.close()


def run_incremental_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    state = _state(size_bytes)
    names = sorted(state)
    rows = bench_changed(state, workdir, reps, names[:CHANGED],
                         f"save, {100 * CHANGED / TENSORS:.1f}% changed, fsync'd", floor=True)
    rows += bench_changed(state, workdir, reps, names, "save, everything changed, fsync'd")
    rows += bench_background(state, workdir, reps, names[:CHANGED])
    rows += bench_chain_load(state, workdir, reps, scattered=False)
    rows += bench_chain_load(state, workdir, reps, scattered=True)
    return rows

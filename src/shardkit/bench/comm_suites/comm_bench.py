"""Communication rows: ``Group.all_reduce_`` next to ``torch.distributed.all_reduce``.

Four real ranks (processes, Gloo over loopback) share one group; on it, each
repetition runs shardkit and then torch on the same tensor, so both see the
same machine state. Cases (``docs/benchmarks.md``): one float32 tensor of 4 KiB to
64 MiB; 200 tensors of 4 KiB, coalesced by ``all_reduce_`` versus 200 separate
``torch.distributed.all_reduce`` calls, with one all_reduce of their total
size as the limit. A repetition starts after a barrier and times ``iters``
back-to-back calls on rank 0 (reported per call; about 32 MiB of traffic per
repetition), so small sizes are not lost in timer noise; the implementations
swap order every repetition. Nothing here is a test: no time is asserted.

Example::

    python -m shardkit.bench.comm_suites.comm_bench --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shardkit.bench.common import format_table, row
from shardkit.comm import Group, UniqueId
from shardkit.launch import run_local_ranks

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)


#: A timed repetition here takes well under a second, and on a shared 2-core box four ranks'
#: scheduling moves single medians by +-10 %; at least this many repetitions per figure.
MIN_REPS = 15


def _iters(nbytes: int) -> int:
    # About 32 MiB of traffic per timed repetition (at least 2 calls): a 1 MiB
    # call takes a few ms, so a handful of them would be mostly timer and scheduler noise.
    return max(2, min(100, (32 * MIB) // nbytes))


def _timed(g: Group, fn, iters: int) -> float:
    g.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _cases(g: Group, sizes, n_small: int, small_bytes: int):
    """(case, {impl: (fn, kind)}, iters, bytes) for every row group, built on this rank's tensors."""
    pg = g.process_group
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        impls = {"shardkit": (lambda t=t: g.all_reduce_([t]), "ours"),
                 "torch.distributed.all_reduce": (lambda t=t: dist.all_reduce(t, group=pg), "peer")}
        yield f"all_reduce 4 ranks {_label(nbytes)}", impls, _iters(nbytes), nbytes
    smalls = [torch.ones(small_bytes // 4) for _ in range(n_small)]
    whole = torch.ones(n_small * small_bytes // 4)
    impls = {
        "shardkit": (lambda: g.all_reduce_(smalls), "ours"),
        f"{n_small} x torch.distributed.all_reduce": (lambda: [dist.all_reduce(s, group=pg) for s in smalls], "peer"),
        "one all_reduce of the total size": (lambda: dist.all_reduce(whole, group=pg), "limit"),
    }
    yield f"{n_small} tensors x {_label(small_bytes)}", impls, 5, n_small * small_bytes


def _label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _rank_main(rank, world_size, uid_bytes, reps, sizes, n_small, small_bytes):
    torch.set_num_threads(1)  # 4 ranks share a small machine; same for every impl
    with Group.init_rank(rank, world_size, UniqueId.from_bytes(uid_bytes), timeout=60) as g:
        rows = []
        for case, impls, iters, nbytes in _cases(g, sizes, n_small, small_bytes):
            for fn, _ in impls.values():
                _timed(g, fn, 1)  # warm-up: connections, allocator
            times = {impl: [] for impl in impls}
            for rep in range(reps):  # interleaved, so drift hits every impl alike
                order = list(impls.items())
                if rep % 2:
                    order.reverse()  # and neither always goes first after the barrier
                for impl, (fn, _) in order:
                    times[impl].append(_timed(g, fn, iters))
            for impl, (fn, kind) in impls.items():
                ts = times[impl]
                timing = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
                rows.append(row(case, impl, timing, kind=kind, bytes=nbytes))
        return rows if rank == 0 else None


def run_comm_benchmarks(reps: int = 5, sizes=DEFAULT_SIZES, *, world_size: int = 4,
                        n_small: int = 200, small_bytes: int = 4 * KIB) -> list[dict]:
    """Run the communication rows on ``world_size`` local ranks; return rank 0's rows."""
    uid = UniqueId.new(host="127.0.0.1").as_bytes()
    reps = max(MIN_REPS, reps)
    results = run_local_ranks(_rank_main, world_size, uid, reps, tuple(sizes), n_small, small_bytes,
                              init_default_group=False, timeout_s=1800)
    return results[0]


def _ratio_lines(rows: list[dict]) -> list[str]:
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        ours = next(r for r in group if r["impl"] == "shardkit")
        for r in group:
            if r is not ours:
                lines.append(f"{case:<28} shardkit time / {r['impl']} time = {ours['median_s'] / r['median_s']:.3f}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-mib", type=int, default=64, help="largest single-tensor size")
    args = parser.parse_args(argv)
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_mib * MIB]
    rows = run_comm_benchmarks(args.reps, sizes)
    print(format_table(rows))
    print()
    print("\n".join(_ratio_lines(rows)))


if __name__ == "__main__":
    main()

"""Scale: metadata size, save and load time and rank 0's received traffic against ranks x tensors.

How it measures (``shardkit bench --only scale`` or ``python -m shardkit.bench.checkpoint_suites.scale_bench``);
``bench/checkpoint_suites/scale_processes.py`` measures the same rows with every rank a process (the default
of ``python -m shardkit.bench.checkpoint_suites.scale_bench``; ``--only scale`` runs both kinds):

- ``ranks`` ranks are the threads of ``comm.Group.local(ranks)`` (real Gloo over
  loopback inside one process). Each rank saves ``tensors`` tiny sharded
  tensors: a ``rank_state`` of ``tensors`` 4-element float32 tensors, stored as
  ``tensors`` chunked tensors of shape ``(ranks, 4)`` whose row r rank r writes
  (the layout FSDP gives: every tensor has ``ranks`` chunks, so
  ``metadata.json`` holds ranks x tensors chunk records), plus ``tensors``
  replicated tiny plain tensors (written once each);
- rank 0's received and sent bytes and collectives are counted by
  ``checkpoint.coordination.group.EXCHANGE_OBSERVERS`` during the save;
- "first save wall" is the whole collective save (all ranks share the GIL, so
  it sums every rank's work), the first in the row; "save wall" the median of
  the ``STEADY_SAVES`` after it, into new directories, as a training job
  saves many times; "rank0 save cpu" is rank 0's own thread CPU time in a
  steady save (what one rank pays on a real cluster); "ranks save cpu" the
  sum over every rank's thread ("ranks first save cpu": in the first save);
  "exchanges wall" the wall time of a save's collectives alone: its 3
  rounds (``agreement.agree``: a gather of tiny statuses to rank 0 and a
  broadcast of rank 0's verdict, each round in the slot the save uses) on
  the same thread ranks, the floor the collectives set. A gather or a
  broadcast is N - 1 message hand-offs on N ranks (an all-gather would be
  N x (N - 1)); "load" is one rank's ``load`` (it issues no
  collective), run alone, the faster of ranks 0 and ranks-1;
- the growth exponent of each column is the slope of a least-squares line of
  log(column) against log(ranks x tensors): 1 is linear, 2 quadratic.

What it does not measure: large tensors (see the ``save``/``load`` suites), or
processes across machines (``tests/multiproc/test_multinode.py`` runs two
``torchrun`` launchers).

Example::

    row = measure(8, 16, "/tmp/scale")      # {"ranks": 8, "metadata_bytes": ..., "rank0_recv_bytes": ...}
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import threading
import time

from shardkit.bench.checkpoint_suites.scale_state import load_checked, states, steady_directories

DEFAULT_RANKS = (8, 32, 64)
DEFAULT_TENSORS = 32
COLUMNS = ("metadata_bytes", "first_save_wall_s", "save_wall_s", "rank0_save_cpu_s", "ranks_first_save_cpu_s",
           "ranks_save_cpu_s", "exchanges_wall_s", "load_s",
           "rank0_recv_bytes", "rank0_sent_bytes", "rank0_collectives")


def _on_threads(groups, fn, join_timeout_s: float) -> list:
    results, errors = [None] * len(groups), []

    def run(g):
        try:
            results[g.rank] = fn(g)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank thread did not finish within {join_timeout_s} s")
    if errors:
        raise errors[0]
    return results


def save_counted(groups, tensors: int, directory: str, join_timeout_s: float = 300.0) -> dict:
    """Save on every group of ``groups`` (one thread each); rank 0's bytes received and sent, collectives
    and times."""
    from shardkit.checkpoint import save
    from shardkit.checkpoint.coordination.group import EXCHANGE_OBSERVERS

    counted = {"rank0_recv_bytes": 0, "rank0_sent_bytes": 0, "rank0_collectives": 0, "rank0_exchanges": 0}
    lock = threading.Lock()

    def observe(rank, collectives, received_bytes, sent_bytes):
        if rank == 0:
            with lock:
                counted["rank0_collectives"] += collectives
                counted["rank0_recv_bytes"] += received_bytes
                counted["rank0_sent_bytes"] += sent_bytes
                counted["rank0_exchanges"] += 1

    def one(g):
        shared, own = states(g.rank, tensors)
        cpu = time.thread_time()
        save(shared, directory, group=g, rank_state=own)
        return time.thread_time() - cpu

    EXCHANGE_OBSERVERS.append(observe)
    try:
        start = time.perf_counter()
        cpu = _on_threads(groups, one, join_timeout_s)
        counted["save_wall_s"] = time.perf_counter() - start
    finally:
        EXCHANGE_OBSERVERS.remove(observe)
    counted["rank0_save_cpu_s"] = cpu[0]
    counted["ranks_save_cpu_s"] = sum(cpu)
    return counted


def exchanges_only(groups, join_timeout_s: float = 300.0) -> float:
    """Wall seconds of a save's 3 rounds (gather a tiny status to rank 0, broadcast its verdict) in the
    save's own slots, on every group of ``groups``."""
    from shardkit.checkpoint.coordination.agreement import agree
    from shardkit.checkpoint.saving.chunked_save import ROUND_SLOTS

    def one(g):
        for step, slot_bytes in ROUND_SLOTS:
            agree(g, {"error": None}, None, step, on_root=lambda statuses: True, slot_bytes=slot_bytes)

    start = time.perf_counter()
    _on_threads(groups, one, join_timeout_s)
    return time.perf_counter() - start


def load_one(group, tensors: int, directory: str) -> float:
    """Seconds for ``group``'s rank to load its part (``load`` issues no collective, so any thread
    may call it alone); checks the values."""
    return load_checked(group.rank, tensors, directory, group)


def close_all(groups) -> None:
    """Close the groups on one thread each: closed one by one, each waits for its peers' teardown."""
    _on_threads(groups, lambda g: g.close(), 60.0)


def measure(ranks: int, tensors: int, workdir: str) -> dict:
    """One row: save ``tensors`` sharded + ``tensors`` replicated tiny tensors on ``ranks`` thread ranks."""
    from shardkit.comm import Group

    directory = os.path.join(workdir, f"scale-{ranks}x{tensors}")
    shutil.rmtree(directory, ignore_errors=True)
    groups = Group.local(ranks)
    try:
        first = save_counted(groups, tensors, directory)
        steady = [save_counted(groups, tensors, d) for d in steady_directories(directory)]
        row = {"ranks": ranks, "tensors": tensors, **first, "first_save_wall_s": first["save_wall_s"],
               "ranks_first_save_cpu_s": first["ranks_save_cpu_s"],
               **{k: statistics.median(s[k] for s in steady)
                  for k in ("save_wall_s", "rank0_save_cpu_s", "ranks_save_cpu_s")}}
        for d in steady_directories(directory):
            shutil.rmtree(d, ignore_errors=True)
        row["exchanges_wall_s"] = exchanges_only(groups)
        row["load_s"] = min(load_one(g, tensors, directory) for g in (groups[0], groups[-1]))
    finally:
        close_all(groups)
    row["metadata_bytes"] = os.path.getsize(os.path.join(directory, "metadata.json"))
    shutil.rmtree(directory, ignore_errors=True)
    return row


def growth_exponent(xs, ys) -> float:
    """Slope of the least-squares line of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def format_scale_table(rows: list[dict]) -> str:
    head = ["ranks", "tensors", "ranks*tensors", *COLUMNS]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["ranks"], r["tensors"], r["ranks"] * r["tensors"],
                 *(f"{r[c]:.4f}" if c.endswith("_s") else r[c] for c in COLUMNS)]
        lines.append(" | ".join(str(c) for c in cells))
    if len(rows) > 1:
        xs = [r["ranks"] * r["tensors"] for r in rows]
        slopes = [f"{growth_exponent(xs, [r[c] for r in rows]):.2f}" for c in COLUMNS]
        lines.append(" | ".join(["exponent", "", "", *slopes]))
    return "\n".join(lines)


#: How ranks run: ``processes`` (one forked process each, the default process group; what a cluster
#: runs) and ``threads`` (``Group.local`` in this process; their GIL and shared heap grow with ranks).
RANK_KINDS = ("processes", "threads")


def measure_as(kind: str, ranks: int, tensors: int, workdir: str) -> dict:
    """One row with ranks run as ``kind`` (one of ``RANK_KINDS``)."""
    if kind == "processes":
        from shardkit.bench.checkpoint_suites.scale_processes import measure_processes

        return {"ranks_as": kind, **measure_processes(ranks, tensors, workdir)}
    if kind == "threads":
        return {"ranks_as": kind, **measure(ranks, tensors, workdir)}
    raise ValueError(f"ranks run as one of {RANK_KINDS}, got {kind!r}")


def run_scale_benchmarks(workdir: str, ranks=DEFAULT_RANKS, tensors: int = DEFAULT_TENSORS,
                         kinds=RANK_KINDS) -> list[dict]:
    """The rows for ``shardkit bench --only scale`` (one run per rank count and kind); prints the fitted tables."""
    rows = []
    for kind in kinds:
        mine = [measure_as(kind, r, tensors, workdir) for r in ranks]
        print(f"ranks as {kind}:\n{format_scale_table(mine)}", file=sys.stderr, flush=True)
        rows += mine
    # The runner's common table shows the save wall time; the fitted tables above have every column.
    return [{"suite": "scale", "case": f"scale save {r['ranks']}x{r['tensors']} ({r['ranks_as']})", "impl": "shardkit",
             "median_s": r["save_wall_s"], "min_s": r["save_wall_s"], "max_s": r["save_wall_s"], **r}
            for r in rows]


def main(argv: list[str]) -> None:
    """``python -m shardkit.bench.checkpoint_suites.scale_bench [RANKS,...] [TENSORS] [processes|threads]``: one fitted table."""
    import tempfile

    ranks = [int(n) for n in argv[0].split(",")] if argv else list(DEFAULT_RANKS)
    tensors = int(argv[1]) if len(argv) > 1 else DEFAULT_TENSORS
    kind = argv[2] if len(argv) > 2 else RANK_KINDS[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure_as(kind, n, tensors, tmp) for n in ranks]
    print(f"ranks as {kind}:\n{format_scale_table(rows)}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Scale on process ranks: the same rows as ``scale_bench``, each rank a real process.

Thread ranks (``scale_bench.measure``) share one interpreter: at 64 ranks on
2 cores their GIL hand-offs and the garbage collector walking one shared heap
grow faster than the work, which a cluster never pays. Here every rank is a
process forked by ``launch.run_local_ranks`` (Gloo over loopback, the default
process group, ``save(..., group=None)`` as a ``torchrun`` job calls it), with
the same state per rank as the thread rows:

- "first save wall" is rank 0's time between a barrier before the first save
  and one after it: every rank's save, sharing this machine's cores, each
  process paying its first-call costs (lazy imports, fresh pages);
- "save wall" is the median of ``scale_bench.STEADY_SAVES`` saves after it,
  into new directories, timed the same way (a training job saves many times);
- "rank0 save cpu" is rank 0's process CPU time over a steady save (Gloo's
  threads included, its loop waking every 10 ms); "ranks save cpu" the sum
  over every rank ("ranks first save cpu": the same over the first save);
- "exchanges wall" the save's 3 rounds alone (``agreement.agree`` in the
  save's slots), between the same barriers;
- "load" is one rank's ``load`` while the others wait at a barrier (a
  blocking wait, no CPU), the faster of ranks 0 and ranks-1;
- rank 0's received and sent bytes and collectives are counted in rank 0's
  process by ``checkpoint.group.EXCHANGE_OBSERVERS``.

What it does not measure: ranks on other machines (``tests/multiproc/test_multinode.py``
runs two ``torchrun`` launchers), or large tensors.

Example::

    row = measure_processes(8, 16, "/tmp/scale")   # {"ranks": 8, "save_wall_s": ..., "rank0_recv_bytes": ...}
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

from shardkit.bench.scale_bench import states, steady_directories


def _timed_between_barriers(fn) -> tuple[float, float]:
    """(wall s, this process's CPU s) of ``fn()`` on every rank, from one barrier to the next."""
    import torch.distributed as dist

    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu


def _save_counted(rank: int, tensors: int, directory: str) -> dict:
    from shardkit.checkpoint import save
    from shardkit.checkpoint.group import EXCHANGE_OBSERVERS

    counted = {"rank0_recv_bytes": 0, "rank0_sent_bytes": 0, "rank0_collectives": 0, "rank0_exchanges": 0}

    def observe(observed_rank, collectives, received_bytes, sent_bytes):
        if observed_rank == 0:
            counted["rank0_collectives"] += collectives
            counted["rank0_recv_bytes"] += received_bytes
            counted["rank0_sent_bytes"] += sent_bytes
            counted["rank0_exchanges"] += 1

    shared, own = states(rank, tensors)
    EXCHANGE_OBSERVERS.append(observe)
    try:
        counted["first_save_wall_s"], counted["first_save_cpu_s"] = _timed_between_barriers(
            lambda: save(shared, directory, rank_state=own))
    finally:
        EXCHANGE_OBSERVERS.remove(observe)
    steady = [_timed_between_barriers(lambda d=d: save(shared, d, rank_state=own))
              for d in steady_directories(directory)]
    counted["save_wall_s"] = statistics.median(wall for wall, _ in steady)
    counted["save_cpu_s"] = statistics.median(cpu for _, cpu in steady)
    if rank == 0:  # every rank has passed the barrier after the last save
        for d in steady_directories(directory):
            shutil.rmtree(d, ignore_errors=True)
    return counted


def _exchanges_wall(rank: int, world_size: int) -> float:
    import torch.distributed as dist

    from shardkit.checkpoint.agreement import agree
    from shardkit.checkpoint.chunked_save import ROUND_SLOTS
    from shardkit.checkpoint.group import resolve_group

    coordinator = resolve_group(dist.group.WORLD, rank, world_size)

    def rounds():
        for step, slot_bytes in ROUND_SLOTS:
            agree(coordinator, {"error": None}, None, step, on_root=lambda statuses: True, slot_bytes=slot_bytes)

    return _timed_between_barriers(rounds)[0]


def _load_alone(rank: int, world_size: int, tensors: int, directory: str) -> float | None:
    """Ranks 0 and world_size-1 each load while every other rank waits at a barrier; their seconds."""
    import torch.distributed as dist

    from shardkit.bench.scale_bench import load_checked

    seconds = None
    for loader in sorted({0, world_size - 1}):
        dist.barrier()
        if rank == loader:
            seconds = load_checked(rank, tensors, directory)
    dist.barrier()
    return seconds


def _rank_row(rank: int, world_size: int, tensors: int, directory: str) -> dict:
    row = _save_counted(rank, tensors, directory)
    row["exchanges_wall_s"] = _exchanges_wall(rank, world_size)
    row["load_s"] = _load_alone(rank, world_size, tensors, directory)
    return row


def measure_processes(ranks: int, tensors: int, workdir: str, timeout_s: float = 600) -> dict:
    """One row like ``scale_bench.measure``'s, on ``ranks`` rank processes."""
    from shardkit.launch import run_local_ranks

    directory = os.path.join(workdir, f"scale-procs-{ranks}x{tensors}")
    shutil.rmtree(directory, ignore_errors=True)
    per_rank = run_local_ranks(_rank_row, ranks, tensors, directory, timeout_s=timeout_s, workdir=workdir)
    rank0 = per_rank[0]
    row = {"ranks": ranks, "tensors": tensors, **{k: rank0[k] for k in (
        "rank0_recv_bytes", "rank0_sent_bytes", "rank0_collectives", "rank0_exchanges", "first_save_wall_s",
        "save_wall_s", "exchanges_wall_s")}}
    row["rank0_save_cpu_s"] = rank0["save_cpu_s"]
    row["ranks_save_cpu_s"] = sum(r["save_cpu_s"] for r in per_rank)
    row["ranks_first_save_cpu_s"] = sum(r["first_save_cpu_s"] for r in per_rank)
    row["load_s"] = min(r["load_s"] for r in per_rank if r["load_s"] is not None)
    row["metadata_bytes"] = os.path.getsize(os.path.join(directory, "metadata.json"))
    shutil.rmtree(directory, ignore_errors=True)
    return row

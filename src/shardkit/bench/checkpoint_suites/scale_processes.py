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
  process by ``checkpoint.coordination.group.EXCHANGE_OBSERVERS``.

A control (``python -m shardkit.bench.checkpoint_suites.scale_processes JOBS RANKS TENSORS``,
:func:`per_rank_cpu_one_job_vs_many`): the per-rank CPU of one job of
JOBS x RANKS ranks against JOBS independent jobs of RANKS ranks each, run at
once on this machine, and of one RANKS-rank job alone. If the first two are
equal, what a rank pays grows with the processes sharing the cores, not
with the ranks it saves with.

What it does not measure: ranks on other machines (``tests/multiproc/test_multinode.py``
runs two ``torchrun`` launchers), or large tensors.

Example::

    row = measure_processes(8, 16, "/tmp/scale")   # {"ranks": 8, "save_wall_s": ..., "rank0_recv_bytes": ...}
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from shardkit.bench.checkpoint_suites.scale_state import states, steady_directories


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
    from shardkit.checkpoint.coordination.group import EXCHANGE_OBSERVERS

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

    from shardkit.checkpoint.coordination.agreement import agree
    from shardkit.checkpoint.saving.chunked_save import ROUND_SLOTS
    from shardkit.checkpoint.coordination.group import resolve_group

    coordinator = resolve_group(dist.group.WORLD, rank, world_size)

    def rounds():
        for step, slot_bytes in ROUND_SLOTS:
            agree(coordinator, {"error": None}, None, step, on_root=lambda statuses: True, slot_bytes=slot_bytes)

    return _timed_between_barriers(rounds)[0]


def _load_alone(rank: int, world_size: int, tensors: int, directory: str) -> float | None:
    """Ranks 0 and world_size-1 each load while every other rank waits at a barrier; their seconds."""
    import torch.distributed as dist

    from shardkit.bench.checkpoint_suites.scale_state import load_checked

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


#: How long a job of the control waits for the others to start (64 processes on 2 cores take a while).
_JOBS_START_TIMEOUT_S = 300.0


def _job_rank(rank: int, world_size: int, tensors: int, directory: str, ready_dir: str, jobs: int) -> dict:
    """One rank of one of several jobs: every job's ranks start saving once all jobs are up."""
    import torch.distributed as dist

    if rank == 0:
        open(os.path.join(ready_dir, f"{os.getpid()}.ready"), "w").close()
        deadline = time.monotonic() + _JOBS_START_TIMEOUT_S
        while len([n for n in os.listdir(ready_dir) if n.endswith(".ready")]) < jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all {jobs} jobs of the control started within {_JOBS_START_TIMEOUT_S} s")
            time.sleep(0.01)
    dist.barrier()
    return _save_counted(rank, tensors, directory)


def _run_job(ranks: int, tensors: int, directory: str, ready_dir: str, jobs: int) -> dict:
    from shardkit.launch import run_local_ranks

    per_rank = run_local_ranks(_job_rank, ranks, tensors, directory, ready_dir, jobs, timeout_s=900,
                               workdir=os.path.dirname(directory))
    shutil.rmtree(directory, ignore_errors=True)
    return {"first_save_cpu_s": [r["first_save_cpu_s"] for r in per_rank],
            "save_cpu_s": [r["save_cpu_s"] for r in per_rank]}


def per_rank_cpu_one_job_vs_many(jobs: int, ranks: int, tensors: int, workdir: str) -> dict:
    """Mean CPU seconds per rank of a first and a steady save: one job of ``ranks`` ranks alone, one job
    of ``jobs x ranks`` ranks, then ``jobs`` jobs of ``ranks`` ranks at once (each a ``python -m`` child,
    started together)."""
    alone = measure_processes(ranks, tensors, workdir)
    one = measure_processes(jobs * ranks, tensors, workdir)
    ready_dir = os.path.join(workdir, "jobs-ready")
    shutil.rmtree(ready_dir, ignore_errors=True)
    os.makedirs(ready_dir)
    children = [subprocess.Popen([sys.executable, "-m", "shardkit.bench.checkpoint_suites.scale_processes", "--job", str(ranks),
                                  str(tensors), os.path.join(workdir, f"job{j}"), ready_dir, str(jobs)],
                                 stdout=subprocess.PIPE, text=True) for j in range(jobs)]
    outputs = [child.communicate()[0] for child in children]
    if any(child.returncode for child in children):
        raise RuntimeError(f"a job of the control failed: exit codes {[c.returncode for c in children]}")
    many = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    n = jobs * ranks
    return {"processes": n,
            "one_small_job_alone_first_save_cpu_per_rank_s": alone["ranks_first_save_cpu_s"] / ranks,
            "one_small_job_alone_save_cpu_per_rank_s": alone["ranks_save_cpu_s"] / ranks,
            "one_job_first_save_cpu_per_rank_s": one["ranks_first_save_cpu_s"] / n,
            "one_job_save_cpu_per_rank_s": one["ranks_save_cpu_s"] / n,
            "many_jobs_first_save_cpu_per_rank_s": sum(sum(m["first_save_cpu_s"]) for m in many) / n,
            "many_jobs_save_cpu_per_rank_s": sum(sum(m["save_cpu_s"]) for m in many) / n}


def main(argv: list[str]) -> None:
    """``JOBS RANKS TENSORS``: print the control's figures (``--job ...`` is one child job)."""
    if argv[0] == "--job":
        ranks, tensors, directory, ready_dir, jobs = int(argv[1]), int(argv[2]), argv[3], argv[4], int(argv[5])
        print(json.dumps(_run_job(ranks, tensors, directory, ready_dir, jobs)), flush=True)
        return
    import tempfile

    jobs, ranks, tensors = (int(a) for a in argv[:3])
    with tempfile.TemporaryDirectory(prefix="shardkit-scale-control-") as tmp:
        print(json.dumps(per_rank_cpu_one_job_vs_many(jobs, ranks, tensors, tmp), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

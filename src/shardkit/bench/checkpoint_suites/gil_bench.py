"""Training while a background save is in flight: how much slower the steps run, and the time lost per save.

One process, torch on one thread, a tiny ``transformers`` Llama trained on
random tokens (tens of ms a step), and a separate state of ``size_bytes``
(``workload.make_state``) saved in the background every so often. For each
implementation a save is started between two steps (the call is timed:
what the loop is blocked for), the loop goes on training and polls whether
the save is done, and the steps taken meanwhile are timed. Every run's
figures are measured against steps with no save in flight taken in the
same run (``no save`` rows), so a machine that gets busier slows both.

Rows (median, min, max over ``reps`` runs, the implementations interleaved):

- ``train during save: mean step``: the mean step time while the save was
  in flight (``no save``: the steps between saves);
- ``train during save: time lost per save``: the blocking call plus, for
  each step taken while it was in flight, what it took beyond the no-save
  mean; ``slowdown`` (mean step in flight / no-save mean - 1) rides along.

Implementations: ``async_save`` and ``CheckpointManager.save`` (shardkit, paced at
``knobs.BACKGROUND_DISK_SHARE`` of the disk's speed; ``async_save`` once more unpaced, with the
share at 1, and once with ``knobs.BACKGROUND_DIRECT_IO=False``, its writes through the page cache),
``dcp.async_save`` in its thread mode and in its process mode (its writer
process started by an untimed first save). Each implementation saves once
untimed first, so every timed save reuses its staging memory. One more row,
``floor: another process writes the bytes``, is no implementation: a helper
process already holding ``size_bytes`` in its own memory writes them to a
file and fsyncs it. It copies nothing out of the trainer and holds none of
its locks, so the slowdown it causes is what the writing alone costs the
training loop on this machine (memory bandwidth, the page cache, the
cores): a lower bound for every background save. And a control,
``control: nothing in flight``: the loop polls a timer of ``CONTROL_S`` instead of a save, so its
row is what the figures read when nothing at all runs beside the steps (the
machine's own step-to-step noise, which a single save's slowdown cannot be
told apart from).

It does not measure the write's throughput (the ``async`` suite does) or
multi-rank saves. Example::

    rows = run_gil_benchmarks(300 << 20, reps=3, workdir="/tmp/bench")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import select
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from shardkit.bench.common import row
from shardkit.bench.peers import single_process_dcp
from shardkit.bench.workload import make_state

__all__ = ["IMPLS", "FLOOR", "CONTROL", "floor_saver", "control_saver", "run_gil_benchmarks"]

#: Implementation names, in the order of the rows.
IMPLS = ("shardkit", "shardkit CheckpointManager.save", "shardkit, knobs.BACKGROUND_DISK_SHARE=1.0",
         "shardkit, knobs.BACKGROUND_DIRECT_IO=False",
         "torch.distributed.checkpoint.async_save (thread)", "torch.distributed.checkpoint.async_save (process)")

#: The floor: no implementation, see the module docstring.
FLOOR = "floor: another process writes the bytes"

#: The control: no implementation either, see the module docstring; and how long its "save" lasts.
CONTROL = "control: nothing in flight"
CONTROL_S = 1.0

#: Steps with no save in flight, taken before each timed save.
QUIET_STEPS = 8

#: The floor's writer: holds the bytes (touched), and for each path read from stdin writes them, fsyncs,
#: and answers one line.
_FLOOR_WRITER = r"""
import os, sys
data = bytearray(b"\x5a") * int(sys.argv[1])
view, piece = memoryview(data), 16 << 20
print("ready", flush=True)
for line in sys.stdin:
    fd = os.open(line.strip(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for start in range(0, len(view), piece):
        os.write(fd, view[start:start + piece])
    os.fsync(fd)
    os.close(fd)
    print("done", flush=True)
"""


def _trainer() -> Callable[[], None]:
    """One training step of a tiny Llama (about 40-80 ms on one thread of the 2-core VM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1000, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (4, 64))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


class _Saver:
    """``start(dir)`` begins a background save, ``done()`` polls it, ``finish()`` waits (and raises)."""

    def __init__(self, start: Callable[[str], object], done: Callable[[object], bool],
                 finish: Callable[[object], None], close: Callable[[], None] = lambda: None):
        self.start, self.done, self.finish, self.close = start, done, finish, close


def _savers(state: dict, root: str) -> dict[str, _Saver]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from shardkit.checkpoint import CheckpointManager
    from shardkit.checkpoint.api import async_save
    from shardkit.errors import AsyncWaitTimeout

    manager = CheckpointManager(os.path.join(root, "manager"), keep_last=2)
    steps = iter(range(10**6))

    def manager_done(_):
        try:
            manager.wait(timeout=0)
        except AsyncWaitTimeout:
            return False
        return True

    def dcp_start(kind):
        def start(path):
            with single_process_dcp():
                return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                      async_checkpointer_type=kind)
        return start

    return {
        FLOOR: floor_saver(sum(t.numel() * t.element_size() for t in state.values())),
        CONTROL: control_saver(CONTROL_S),
        IMPLS[0]: _Saver(lambda path: async_save(state, path), lambda f: f.done(), lambda f: f.wait()),
        IMPLS[1]: _Saver(lambda path: manager.save(next(steps), state), manager_done, lambda _: manager.wait(),
                         manager.close),
        IMPLS[2]: _Saver(lambda path: _with_knob("BACKGROUND_DISK_SHARE", 1.0, lambda: async_save(state, path)),
                         lambda f: f.done(), lambda f: f.wait()),
        IMPLS[3]: _Saver(lambda path: _with_knob("BACKGROUND_DIRECT_IO", False, lambda: async_save(state, path)),
                         lambda f: f.done(), lambda f: f.wait()),
        IMPLS[4]: _Saver(dcp_start(AsyncCheckpointerType.THREAD), lambda f: f.done(), lambda f: f.result()),
        IMPLS[5]: _Saver(dcp_start(AsyncCheckpointerType.PROCESS), lambda f: f.done(), lambda f: f.result()),
    }


def _with_knob(name: str, value, start: Callable[[], object]) -> object:
    """``start()`` with ``knobs.<name>`` set to ``value`` (background saves read their knobs when staged)."""
    from shardkit import knobs

    saved = getattr(knobs, name)
    setattr(knobs, name, value)
    try:
        return start()
    finally:
        setattr(knobs, name, saved)


def floor_saver(size_bytes: int) -> _Saver:
    """The floor's writer process (``_FLOOR_WRITER``), started here and ready when this returns."""
    proc = subprocess.Popen([sys.executable, "-c", _FLOOR_WRITER, str(size_bytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the floor writer process did not start")

    def start(path):
        proc.stdin.write(path + "\n")
        proc.stdin.flush()

    def done(_):
        return bool(select.select([proc.stdout], [], [], 0)[0])

    def finish(_):
        if proc.stdout.readline().strip() != "done":
            raise RuntimeError("the floor writer process failed")

    def close():
        proc.stdin.close()
        proc.wait(timeout=60)

    return _Saver(start, done, finish, close)


def control_saver(seconds: float) -> _Saver:
    """A "save" that does nothing and is done ``seconds`` after it starts."""
    return _Saver(lambda _path: time.perf_counter() + seconds, lambda end: time.perf_counter() >= end,
                  lambda _end: None)


def _one_save(step: Callable[[], None], saver: _Saver, path: str) -> dict:
    """Quiet steps, then one save with the loop training until it is done; the run's figures."""
    quiet = []
    for _ in range(QUIET_STEPS):
        start = time.perf_counter()
        step()
        quiet.append(time.perf_counter() - start)
    base = statistics.median(quiet)
    began = time.perf_counter()
    handle = saver.start(path)
    blocked = time.perf_counter() - began
    busy = []
    while not saver.done(handle):
        start = time.perf_counter()
        step()
        busy.append(time.perf_counter() - start)
    saver.finish(handle)
    in_flight = time.perf_counter() - began
    mean = statistics.fmean(busy) if busy else base
    return {"blocked_s": blocked, "quiet_step_s": base, "step_s": mean, "steps": len(busy), "in_flight_s": in_flight,
            "lost_s": blocked + sum(t - base for t in busy), "slowdown": mean / base - 1}


def _summary(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs]
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def run_gil_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    """The rows described in the module docstring, for a state of ``size_bytes``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = os.path.join(workdir, "gil")
    try:
        return _run(size_bytes, max(1, reps), root)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _one_rank_group():
    """A Gloo group of this one process (DCP's process mode needs a default group and MASTER_ADDR/PORT)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _run(size_bytes: int, reps: int, root: str) -> list[dict]:
    with _one_rank_group():
        return _rows(size_bytes, reps, root)


def _rows(size_bytes: int, reps: int, root: str) -> list[dict]:
    step, state = _trainer(), make_state(size_bytes)
    savers = _savers(state, root)
    names = (*IMPLS, FLOOR, CONTROL)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for rep in range(reps + 1):  # the first round is untimed: staging memory, DCP's writer process
            for name in names[::-1] if rep % 2 else names:
                path = os.path.join(root, f"{names.index(name)}-{rep}")
                result = _one_save(step, savers[name], path)
                if rep:
                    runs[name].append(result)
                if "shardkit CheckpointManager" not in name:   # the manager removes its own old steps
                    shutil.rmtree(path, ignore_errors=True)
                    os.sync()   # the removal's journal and discards land here, not in the next one's quiet steps
    finally:
        for saver in savers.values():
            saver.close()
    quiet = [r for rs in runs.values() for r in rs]
    rows = [row("train during save: mean step", "no save", _summary(quiet, "quiet_step_s"), kind="limit")]
    for name in names:
        extra = {"slowdown": statistics.median(r["slowdown"] for r in runs[name]),
                 "slowdowns": [round(r["slowdown"], 3) for r in runs[name]],
                 "blocked_s": statistics.median(r["blocked_s"] for r in runs[name]),
                 "in_flight_s": statistics.median(r["in_flight_s"] for r in runs[name]),
                 "steps_in_flight": statistics.median(r["steps"] for r in runs[name])}
        rows.append(row("train during save: mean step", name, _summary(runs[name], "step_s"),
                        **({"kind": "limit"} if name in (FLOOR, CONTROL) else {}), **extra))
    for name in IMPLS:
        rows.append(row("train during save: time lost per save", name, _summary(runs[name], "lost_s")))
    return rows

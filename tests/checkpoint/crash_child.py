"""The process a crash test kills: it saves a checkpoint and SIGKILLs itself at a chosen point.

Run in a child process only (``test_crash.py`` forks it from a forkserver).
It wraps the storage layer's atomic writer, ``os.pwrite`` and ``os.replace`` in this process,
so production code carries no test hooks. Kill points (``kill`` dict):

- ``{"at": "bytes", "file": "rank_0.safetensors", "n": N}``: after exactly N
  bytes of that file (its temporary name) are written; ``"file": None``
  counts the bytes of every file;
- ``{"at": "before_publish", "file": F}``: F is written and fsync'd under its
  temporary name, not yet renamed;
- ``{"at": "after_publish", "file": F}``: F was just renamed to its final name.

If the save finishes without reaching the kill point the child exits with
code 3, so a test notices a hook that never fired (e.g. the writer changed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch

STATE_SEEDS = {"old": 0, "new": 1}


def make_state(which: str, rank: int = 0, world_size: int = 1) -> dict:
    """The state saved by the crash tests: nested, several dtypes, rank's rows of "w"."""
    g = torch.Generator().manual_seed(STATE_SEEDS[which])
    w = torch.randn(64, 256, generator=g)                    # 64 KiB, sharded on dim 0
    emb = torch.randn(100, 33, generator=g).to(torch.bfloat16)
    ids = torch.randint(-(2**40), 2**40, (50,), generator=g, dtype=torch.int64)
    rows = 64 // world_size
    return {
        "model": {"w": w[rank * rows : (rank + 1) * rows].clone(), "emb": emb},
        "optim": {"state": [{"ids": ids, "step": 10 + STATE_SEEDS[which]}]},
        "tag": which,
    }


def spec(world_size: int):
    from shardkit.checkpoint import ShardMetadata, TensorShardSpec

    rows = 64 // world_size
    return ShardMetadata(world_size, {"model.w": TensorShardSpec((64, 256), 0, (rows,) * world_size)})


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Bytes:
    """Counts the bytes written to the files being published; dies at the kill point.

    Every write path of this process goes through :meth:`write`: ``f.write``
    on the writer's file object and ``os.write`` / ``os.pwrite`` on its file
    descriptor (the storage layer may write positionally from a thread pool).
    """

    def __init__(self, kill: dict):
        self.kill, self.seen, self.fd_names = kill, 0, {}
        self.lock = threading.Lock()

    def write(self, name: str, data, do_write):
        kill = self.kill
        if kill["at"] != "bytes" or kill["file"] not in (None, name):
            return do_write(data)
        view = memoryview(data).cast("B")
        with self.lock:  # one writer at a time, so "after exactly N bytes" holds across threads
            if self.seen + len(view) >= kill["n"]:
                do_write(view[: kill["n"] - self.seen])
                _die()
            n = do_write(view)
            self.seen += len(view) if n is None else n
            return n


class _CountingFile:
    def __init__(self, f, name: str, counter: _Bytes):
        self._f, self._name, self._counter = f, name, counter

    def write(self, data):
        return self._counter.write(self._name, data, self._f.write)

    def __getattr__(self, attr):
        return getattr(self._f, attr)


def install_kill_hooks(kill: dict) -> None:
    """Make this process SIGKILL itself at ``kill`` (see the module docstring)."""
    import shardkit.storage.backends.atomic as atomic
    import shardkit.storage.backends.local as local_backend

    real_writer, real_replace = atomic.atomic_local_writer, os.replace
    real_write, real_pwrite = os.write, os.pwrite
    counter = _Bytes(kill)

    @contextlib.contextmanager
    def writer(path, durable=True):
        with real_writer(path, durable) as f:
            name = os.path.basename(path)
            fd = f.fileno()
            counter.fd_names[fd] = name
            try:
                yield _CountingFile(f, name, counter)
            finally:
                counter.fd_names.pop(fd, None)

    def write(fd, data):
        name = counter.fd_names.get(fd)
        return real_write(fd, data) if name is None else counter.write(name, data, lambda d: real_write(fd, d))

    def pwrite(fd, data, offset):
        name = counter.fd_names.get(fd)
        if name is None:
            return real_pwrite(fd, data, offset)
        return counter.write(name, data, lambda d: real_pwrite(fd, d, offset))

    def replace(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(dst))
        if kill["at"] == "before_publish" and name == kill["file"]:
            _die()
        real_replace(src, dst, *args, **kwargs)
        if kill["at"] == "after_publish" and name == kill["file"]:
            _die()

    atomic.atomic_local_writer = writer
    local_backend.atomic_local_writer = writer
    os.replace, os.write, os.pwrite = replace, write, pwrite


def save_and_die(directory: str, which: str, kill: dict, world_size: int = 1) -> None:
    """Save ``make_state(which)`` into ``directory`` (each rank in turn, no group), dying at ``kill``.

    ``kill["ranks"]`` (optional) is the order the ranks save in; default 0, 1, ...
    """
    torch.set_num_threads(1)
    from shardkit.checkpoint import save_distributed

    install_kill_hooks(kill)
    for rank in kill.get("ranks", range(world_size)):
        # overwrite=True: the "overwrite" mode is exactly an in-place overwrite without a group,
        # crashed; a no-op for a fresh directory.
        save_distributed(make_state(which, rank, world_size), directory, rank, world_size, spec(world_size),
                         overwrite=True)
    os._exit(3)  # the kill point was never reached

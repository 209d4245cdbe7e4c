"""Fork snapshots: a child process holds a copy-on-write image of the state and writes it.

``os.fork`` gives the child the parent's memory as it is at that instant,
shared page by page until one side writes (copy-on-write), so a background
save can capture a CPU state in the time it takes to copy page tables
(tens of milliseconds for gigabytes) instead of copying its bytes. The
parent goes on training; each page it writes while the child lives is
copied once, by the kernel, at that write. This is how Redis' ``BGSAVE``
snapshots its dataset.

:class:`ForkSnapshot` forks at construction, then the child waits: nothing
is written until :meth:`ForkSnapshot.run` says so (a save first withdraws
the old commit and agrees with the other ranks), and :meth:`close` sends it
away unused. The child runs one job, sends its JSON result back (nothing is
pickled) and exits.

What it does not do: snapshot CUDA tensors (device memory is not part of
the fork; the child could not use CUDA anyway), or memory shared with other
processes (``share_memory_()``, pinned host memory): the parent's later
writes would show through. :func:`fork_eligible` says whether a state is
made only of private CPU tensors; callers copy the others. Fork is Linux
only here (macOS system libraries are not fork-safe).

The child runs only Python, the I/O threads it starts itself, and torch
calls that read tensors on one intra-op thread; a lock held by another
thread of the parent at the fork stays held in the child, so the job must
not need locks that the caller's other threads take (the usual rule for
fork without exec, the same one ``DataLoader`` workers live by).

Example::

    snap = ForkSnapshot(lambda: {"written": write_files(state)})   # state captured now
    state["w"].add_(1)                                               # not in the snapshot
    print(snap.run())                                                # {'written': ...}
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import warnings
from typing import Any, Callable, Iterable

import torch

from shardkit.errors import CheckpointError

__all__ = ["ForkSnapshot", "fork_applies", "fork_eligible", "fork_supported", "start_fork_save"]

_GO, _QUIT = b"go", b"quit"


def fork_supported() -> bool:
    """True where :class:`ForkSnapshot` can work: Linux (``os.fork``)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def fork_eligible(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every tensor lives in private CPU memory, which a fork snapshots."""
    pinned_possible = torch.cuda.is_available() and torch.cuda.is_initialized()
    for t in tensors:
        if t.device.type != "cpu" or t.untyped_storage().is_shared():
            return False
        if pinned_possible and t.is_pinned():
            return False
    return True


def fork_applies(tensors: Iterable[torch.Tensor], storage) -> bool:
    """True when a save of these tensors to ``storage`` can be snapshotted by a fork.

    Local files only: remote stores' clients (threads, sockets, event loops)
    do not survive a fork.
    """
    from shardkit.storage import LocalStorage

    return fork_supported() and isinstance(storage, LocalStorage) and fork_eligible(tensors)


class ForkSnapshot:
    """A forked child holding this instant's memory, ready to run ``job`` once.

    ``job`` runs in the child and returns a JSON-serialisable value; an
    exception there becomes a :class:`~shardkit.errors.CheckpointError` from
    :meth:`run`. Raises ``OSError`` if the fork itself fails (no memory for
    the page tables, too many processes); callers fall back to copying then.
    """

    def __init__(self, job: Callable[[], Any]):
        self._sock, child_end = socket.socketpair()
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns on every fork of a threaded process; this child
                # follows the rule that warning is about (see the module docstring).
                warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
                pid = os.fork()
        except BaseException:
            self._sock.close()
            child_end.close()
            raise
        if pid == 0:  # the child: never returns
            _child_main(child_end, self._sock, job)
        child_end.close()
        self.pid = pid
        self._used = False
        self._exit_status: int | None = None

    def run(self) -> Any:
        """Let the child run its job; wait for it and return the job's result.

        Raises :class:`~shardkit.errors.CheckpointError` with the child's error,
        or with the signal that killed it (the kernel's OOM killer sends SIGKILL).
        """
        if self._used:
            raise CheckpointError("this snapshot already ran its job; a snapshot is written once")
        self._used = True
        try:
            _send(self._sock, _GO)
            message = _receive(self._sock)
        finally:
            self._sock.close()
            self._reap()
        if message is None:
            raise CheckpointError(f"the snapshot process (pid {self.pid}) {_describe_exit(self._exit_status)} "
                                  f"before it reported; its files are incomplete and were not committed")
        reply = json.loads(message.decode("utf-8"))
        if "error" in reply:
            raise CheckpointError(f"writing from the snapshot process failed: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        """Send the child away without running its job (idempotent); waits for it to exit."""
        if not self._used:
            self._used = True
            try:
                _send(self._sock, _QUIT)
            except OSError:
                pass  # already gone
            self._sock.close()
        self._reap()

    def _reap(self) -> None:
        if self._exit_status is None:
            _, status = os.waitpid(self.pid, 0)
            self._exit_status = os.waitstatus_to_exitcode(status)


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<Q", len(payload)) + payload)


def _receive(sock: socket.socket) -> bytes | None:
    """One framed message, or None if the other end closed first."""
    head = _receive_exactly(sock, 8)
    return None if head is None else _receive_exactly(sock, struct.unpack("<Q", head)[0])


def _receive_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(min(nbytes - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def start_fork_save(state_dict, target: str, rank: int, world_size: int, shard_spec, group) -> Callable[[], None] | None:
    """Snapshot ``state_dict`` by forking now; return the rest of the save, to run on another thread.

    The returned callable runs the whole ``save_distributed`` protocol in this
    process (withdraw, group agreement, commit) and has the child write this
    rank's files from the snapshot. Returns None, having forked nothing, when
    the state or the target cannot be snapshotted this way (see
    :func:`fork_eligible`; remote storage: its clients' threads and sockets do
    not survive a fork) or when the fork fails; the caller then copies.
    Errors in the state's layout are not raised here: the returned callable
    raises them (after telling the other ranks, with a group).
    """
    from shardkit.checkpoint.group import resolve_group
    from shardkit.checkpoint.save import prepare_save, run_save, write_rank_files
    from shardkit.checkpoint.spec import check_world
    from shardkit.storage import FileRecord, storage_for

    storage, directory = storage_for(target)
    try:
        prep, failure = prepare_save(state_dict, rank, world_size, shard_spec, None), None
    except Exception as e:  # noqa: BLE001 - raised by the save, where the other ranks hear of it
        prep, failure, snap = None, e, None
    if prep is not None:
        if not fork_applies(prep.flat.tensors.values(), storage):
            return None
        try:
            snap = ForkSnapshot(lambda: {f: r.to_json() for f, r in write_rank_files(storage, directory, prep).items()})
        except OSError:
            return None  # no memory for the page tables, or no more processes: copy instead
        prep.flat.tensors.clear()  # the child has them; this process need not keep them alive

    def prepared():
        if failure is not None:
            raise failure
        return prep

    def write_in_child(_storage, _directory, _prep):
        return {f: FileRecord.from_json(f, r) for f, r in snap.run().items()}

    def finish() -> None:
        try:
            check_world(rank, world_size)
            run_save(storage, directory, resolve_group(group, rank, world_size), prepared, write_in_child)
        finally:
            if snap is not None:
                snap.close()

    finish.cancel = snap.close if snap is not None else (lambda: None)  # if it will never run
    return finish


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _child_main(sock: socket.socket, parent_end: socket.socket, job: Callable[[], Any]) -> None:
    """In the child: wait for go (or quit, or the parent's end closing), run ``job``, reply, exit.

    Never returns: whatever happens, the child leaves through ``os._exit``
    (no atexit handlers, no finalizers of the parent's objects, no flush of
    the parent's buffered output).
    """
    status = 1
    try:
        parent_end.close()  # holding it would hide the parent's death from recv
        torch.set_num_threads(1)  # no intra-op pool: its threads did not survive the fork
        if _receive(sock) == _GO:
            try:
                reply = json.dumps({"result": job()})
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                reply = json.dumps({"error": f"{type(e).__name__}: {e}"})
            _send(sock, reply.encode("utf-8"))
        status = 0
    finally:
        os._exit(status)

"""Process groups: create them, split them, abort and close them.

A :class:`Group` is one rank's handle on a set of ranks that run collectives
together (the collectives live in :mod:`shardkit.comm.collectives`). It wraps a
``torch.distributed`` ``ProcessGroup`` (Gloo for CPU tensors, NCCL for CUDA)
and never moves bytes over a transport of its own.

Example::

    uid = UniqueId.new()                         # share uid.as_bytes() with every rank
    with Group.init_rank(rank, 4, uid) as g:
        g.all_reduce_([grad], ReduceOp.AVG)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit.comm.abort import AbortHandle, translate_failure, wait_work
from shardkit import knobs
from shardkit.comm.backends import (
    abort_process_group,
    build_process_group,
    extend_nccl_watchdog,
    init_default_group,
    resolve_backend,
)
from shardkit.comm.collectives import Collectives
from shardkit.comm.unique_id import UniqueId
from shardkit.errors import CommAbortedError, CommArgumentError, CommError, CommTimeoutError, InvalidRankError

__all__ = ["Group", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = timedelta(seconds=60)
# Groups whose backend thread may still be blocked: destroying them would join
# that thread and hang close(), so they are kept alive until the process ends.
_UNSAFE_TO_DESTROY: list = []


def _as_timeout(timeout) -> timedelta:
    if isinstance(timeout, timedelta):
        t = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        t = timedelta(seconds=timeout)
    else:
        raise CommArgumentError(f"timeout must be a timedelta or seconds, got {timeout!r}")
    if t.total_seconds() <= 0:
        raise CommArgumentError(f"timeout must be positive, got {t.total_seconds()} s")
    return t


def _check_world(rank, world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidRankError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidRankError(
            f"rank {rank!r} is out of range for world_size={world_size}; "
            f"ranks are 0..{world_size - 1}. Give each process a distinct rank below world_size."
        )


def _rendezvous_store(rank, world_size, host, port, is_master, timeout):
    if world_size == 1:
        return dist.HashStore()  # no peers: nothing to meet over the network
    return dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False)


#: (MASTER_ADDR, MASTER_PORT) -> the store ``Group.from_env`` met on there, reused by later calls in this
#: process: rank 0 cannot serve the port twice.
_ENV_STORES: dict[tuple[str, int], dist.Store] = {}
_ENV_JOINS = itertools.count()


def _env_store(rank, world_size, host, port, serve, timeout):
    """The store for ``Group.from_env``: this process's earlier one for ``host:port``, else a new one.

    Rank 0 serves it, unless something in this process already does
    (``torch.distributed.init_process_group(init_method="env://")`` binds
    MASTER_PORT too): then it joins that server as a client, as the other
    ranks do.
    """
    if world_size == 1:
        return dist.HashStore()
    store = _ENV_STORES.get((host, port))
    if store is None:
        try:
            store = dist.TCPStore(host, port, world_size, serve, timeout=timeout, wait_for_workers=False)
        except RuntimeError as e:
            if not (serve and "EADDRINUSE" in str(e)):
                raise
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        _ENV_STORES[host, port] = store
    return store


def _env_prefix() -> str:
    """Keys of the n-th ``from_env`` group of this process (every rank counts its calls alike), per
    launcher restart: an agent's store outlives the workers of a failed attempt."""
    return f"shardkit/env/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_ENV_JOINS)}/"


class Group(Collectives):
    """One rank's handle on a group of ranks; build it with ``init_rank``, ``from_env`` or ``local``.

    Not thread-safe: one thread issues the collectives of a given ``Group``
    (``Group.local`` gives one per thread). ``abort_handle()`` is the one
    part meant for other threads.

    Example::

        g0, g1 = Group.local(2)                # two ranks in this process
    """

    def __init__(self, pg, rank, world_size, backend, timeout, store, *, keepalive=(), owns_default=False,
                 loopback=False, device=None):
        self._pg, self.rank, self.world_size = pg, rank, world_size
        self.backend, self._timeout, self._store = backend, timeout, store
        self._keepalive = keepalive  # e.g. rank 0's TCPStore server must outlive the group
        self._owns_default = owns_default
        self._loopback, self._device = loopback, device  # reused by split()
        self._closed = False
        self._failure: str | None = None
        self._split_seq = 0
        self._abort = AbortHandle(on_abort=self._backend_abort)
        # Read once: the NCCL watchdog's timeout below must match how this group waits.
        self._gpu_host_wait = backend == "nccl" and knobs.COMM_NCCL_BLOCKING_WAIT
        if self._gpu_host_wait:
            extend_nccl_watchdog(pg, timeout)

    # --- construction ------------------------------------------------------

    @classmethod
    def init_rank(cls, rank: int, world_size: int, unique_id, *, backend: str = "auto",
                  timeout=DEFAULT_TIMEOUT) -> "Group":
        """Join the group named by ``unique_id`` as ``rank``; rank 0 hosts the rendezvous store.

        Blocks until all ``world_size`` ranks have joined (or ``timeout``). The
        first group of a process also becomes torch's default process group,
        so torch APIs (DDP, ``torch.distributed.checkpoint``) accept
        ``group.process_group``; later ones are standalone.
        """
        _check_world(rank, world_size)
        uid = unique_id if isinstance(unique_id, UniqueId) else UniqueId.from_bytes(unique_id)
        timeout = _as_timeout(timeout)
        backend = resolve_backend(backend)
        with _joining("Group.init_rank", timeout):
            store = _rendezvous_store(rank, world_size, uid.host, uid.port, rank == 0, timeout)
            return cls._on_store(dist.PrefixStore(uid.store_prefix(), store), rank, world_size,
                                 backend, timeout, keepalive=(store,))

    @classmethod
    def from_env(cls, *, backend: str = "auto", timeout=DEFAULT_TIMEOUT) -> "Group":
        """Join the group described by torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [n for n in names if n not in os.environ]
        if missing:
            raise CommArgumentError(
                f"Group.from_env: environment variables {missing} are not set; start the "
                "processes with torchrun, or use Group.init_rank(rank, world_size, UniqueId)."
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _check_world(rank, world_size)
        timeout, backend = _as_timeout(timeout), resolve_backend(backend)
        # Under torchrun the elastic agent already serves the store on MASTER_PORT.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        with _joining("Group.from_env", timeout):
            store = _env_store(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               rank == 0 and not agent, timeout)
            return cls._on_store(dist.PrefixStore(_env_prefix(), store), rank, world_size,
                                 backend, timeout, keepalive=(store,))

    @classmethod
    def _on_store(cls, store, rank, world_size, backend, timeout, keepalive) -> "Group":
        if not dist.is_initialized():
            pg = init_default_group(dist.PrefixStore("default/", store), rank, world_size, backend, timeout)
            return cls(pg, rank, world_size, backend, timeout, store, keepalive=keepalive, owns_default=True)
        pg = build_process_group(dist.PrefixStore("pg/", store), rank, world_size, backend, timeout)
        return cls(pg, rank, world_size, backend, timeout, store, keepalive=keepalive)

    @classmethod
    def local(cls, world_size: int, *, backend: str = "gloo", timeout=DEFAULT_TIMEOUT) -> list["Group"]:
        """``world_size`` ranks inside this process, one ``Group`` per rank, for one thread each.

        Real Gloo over loopback (or NCCL, one CUDA device per rank), not a
        simulation; each returned group must be driven by its own thread.
        """
        _check_world(0, world_size)
        backend = resolve_backend(backend)
        devices = [torch.device("cuda", r) if backend == "nccl" else None for r in range(world_size)]
        return cls._local_on(devices, backend, timeout)

    @classmethod
    def _local_on(cls, devices, backend, timeout) -> list["Group"]:
        n, timeout = len(devices), _as_timeout(timeout)
        store = dist.PrefixStore("local/", dist.HashStore())

        def make(r):
            pg = build_process_group(dist.PrefixStore("pg/", store), r, n, backend, timeout,
                                     loopback=True, device=devices[r])
            return cls(pg, r, n, backend, timeout, store, loopback=True, device=devices[r])

        return _build_in_threads(n, make)

    def split(self, ranks) -> "Group | None":
        """A new group of ``ranks`` (ranks of this group; new rank = position in the list).

        Every rank of this group calls ``split`` with the same ``ranks``, in the
        same order relative to its other splits; members get the new group,
        the others ``None``. Splits of disjoint rank lists may run at the same time.
        """
        self._check_usable("split")
        ranks = [self._check_rank(r, "rank", "split") for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks):
            raise InvalidRankError(f"split: ranks must be a non-empty list without repeats, got {ranks}")
        self._split_seq += 1
        if self.rank not in ranks:
            return None
        key = f"split{self._split_seq}-{'_'.join(map(str, ranks))}/"
        store = dist.PrefixStore(key, self._store)
        new_rank = ranks.index(self.rank)
        with _joining("Group.split", self._timeout):
            pg = build_process_group(dist.PrefixStore("pg/", store), new_rank, len(ranks), self.backend,
                                     self._timeout, loopback=self._loopback, device=self._device)
        return Group(pg, new_rank, len(ranks), self.backend, self._timeout, store,
                     keepalive=self._keepalive, loopback=self._loopback, device=self._device)

    # --- lifecycle ---------------------------------------------------------

    @property
    def process_group(self):
        """The torch ``ProcessGroup``, for torch APIs (``dist.all_reduce(t, group=...)``, DDP)."""
        self._check_usable("process_group")
        return self._pg

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def abort_handle(self) -> AbortHandle:
        """The handle that aborts this group from any thread (the same object every call)."""
        return self._abort

    def _backend_abort(self) -> None:
        if self._pg is not None:
            _UNSAFE_TO_DESTROY.append(self._pg)  # its thread may be blocked; see close()
            abort_process_group(self._pg, self.backend)

    def _check_usable(self, what: str) -> None:
        if self._abort.is_aborted:
            raise CommAbortedError(
                f"{what}: this group was aborted and accepts no more work; create a new group"
            )
        if self._closed:
            raise CommError(f"{what}: this group is closed; create a new group")
        if self._failure is not None:
            raise CommError(
                f"{what}: this group is unusable after an earlier failure ({self._failure}); "
                "create a new group"
            )

    def _issue(self, what: str, fn, *args):
        """``fn(*args)``: start a backend work; a backend that refuses at once raises a ``CommError``."""
        try:
            return fn(*args)
        except RuntimeError as e:  # DistBackendError, c10::Error: e.g. NCCL's set-up, a peer already gone
            raise CommError(f"{what}: the {self.backend} backend could not start it. "
                            f"Backend said: {str(e).strip()[:400]}") from e

    def _call(self, what: str, fn, *args) -> None:
        """Start a work with ``fn(*args)`` and wait for it."""
        self._wait(self._issue(what, fn, *args), what)

    def _wait(self, work, what: str, has_future: bool | None = None) -> None:
        try:
            wait_work(work, what=what, timeout=self._timeout, handle=self._abort,
                      backend_wait=self.backend == "gloo", has_future=has_future,
                      gpu_host_wait=self._gpu_host_wait)
        except CommError as e:
            if not self._abort.is_aborted:
                self._failure = type(e).__name__
                _UNSAFE_TO_DESTROY.append(self._pg)
                if self._gpu_host_wait:
                    abort_process_group(self._pg, self.backend)  # frees a GPU stuck in the collective
            raise

    def close(self) -> None:
        """Release the group; later calls raise ``CommError``. Idempotent; no collective is run."""
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        if pg is None or any(pg is p for p in _UNSAFE_TO_DESTROY):
            return  # a blocked backend thread would make destruction hang
        if self._owns_default and dist.is_initialized():
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "aborted" if self._abort.is_aborted else "open"
        return f"Group(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, {state})"


@contextlib.contextmanager
def _joining(what: str, timeout: timedelta):
    """Raise a failure to meet the other ranks (the store, the backend's connections) as a CommError."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # torch's DistStoreError / DistNetworkError, Gloo's connect failures
        text = str(e).strip()[:300]
        hint = ("check that every rank was started, with the same world size, address and port, "
                "and that no other program (or earlier group) serves that port")
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CommTimeoutError(f"{what}: not every rank joined within {timeout.total_seconds():g} s; "
                                   f"{hint}. Backend said: {text}") from e
        raise CommError(f"{what}: joining the group failed; {hint}. Backend said: {text}") from e


def _build_in_threads(n, make):
    """Call ``make(rank)`` for every rank at once (rendezvous needs all of them present)."""
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = make(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise translate_failure(errors[0], "Group.local", timedelta(0)) from errors[0]
    return results

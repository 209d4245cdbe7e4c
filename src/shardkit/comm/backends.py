"""Build torch ``ProcessGroup`` objects for shardkit groups.

Two ways, both plain ``torch.distributed``: :func:`build_process_group` wraps
``ProcessGroupGloo`` (and ``ProcessGroupNCCL`` for CUDA tensors) around a store
without touching torch's global state, so many groups can live in one process
(``Group.local``, ``split``); :func:`init_default_group` goes through
``torch.distributed.init_process_group`` so that torch APIs that look up the
default group (DDP, ``torch.distributed.checkpoint``) accept the result.
Nothing here runs a collective.

Example::

    pg = build_process_group(PrefixStore("g/", HashStore()), 0, 1, "gloo", timedelta(seconds=5))
"""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit import knobs
from shardkit.errors import CommArgumentError, UnsupportedOpError

__all__ = ["resolve_backend", "build_process_group", "init_default_group", "extend_nccl_watchdog",
           "abort_process_group"]

_names = itertools.count()


def resolve_backend(backend: str) -> str:
    """``"auto"`` → ``"nccl"`` with CUDA and NCCL present, else ``"gloo"``; validate the rest."""
    backend = (backend or "auto").lower()
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise CommArgumentError(
            f"unknown backend {backend!r}; shardkit groups use 'gloo' (CPU), 'nccl' (CUDA) or 'auto'"
        )
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise UnsupportedOpError(
            "backend='nccl' needs CUDA and a torch build with NCCL; this process has "
            f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}. Use backend='gloo'."
        )
    return backend


def _gloo(store, rank, size, timeout, loopback):
    if not loopback:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Threads of one process talk over loopback: no hostname lookup needed.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store, rank, size, timeout):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def build_process_group(store, rank: int, size: int, backend: str, timeout: timedelta,
                        *, loopback: bool = False, device: torch.device | None = None):
    """A ``ProcessGroup`` on ``store``: Gloo for CPU tensors, plus NCCL for CUDA ones if asked.

    Blocks until all ``size`` ranks have called it with the same store (Gloo
    connects its full mesh here).
    """
    pg = dist.ProcessGroup(store, rank, size)
    gloo = _gloo(dist.PrefixStore("gloo/", store), rank, size, timeout, loopback)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    default = dist.ProcessGroup.BackendType.GLOO
    if backend == "nccl":
        nccl = _nccl(dist.PrefixStore("nccl/", store), rank, size, timeout)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        default = dist.ProcessGroup.BackendType.NCCL
        if device is not None:
            pg.bound_device_id = device
    pg._set_default_backend(default)
    name = f"shardkit_{next(_names)}"
    pg._set_group_name(name)
    pg._set_group_desc(name)
    return pg


def _nccl_backend(pg):
    try:
        return pg._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError):  # no NCCL backend registered (a Gloo-only group)
        return None


def extend_nccl_watchdog(pg, timeout: timedelta) -> None:
    """Give ``pg``'s NCCL watchdog the group's deadline plus ``knobs.NCCL_WATCHDOG_MARGIN_S``.

    For groups that wait on the host (``knobs.COMM_NCCL_BLOCKING_WAIT``), so
    shardkit's ``CommTimeoutError`` comes before the watchdog ends the process.
    """
    nccl = _nccl_backend(pg)
    if nccl is not None:
        extra_s = knobs.COMM_TIMEOUT_SLACK_S + knobs.NCCL_WATCHDOG_MARGIN_S
        nccl._set_default_timeout(timeout + timedelta(seconds=extra_s))


def abort_process_group(pg, backend: str) -> None:
    """Abort ``pg``'s backends, best effort; with NCCL, on a daemon thread, returning at once.

    Aborting NCCL's communicators makes kernels that wait on a dead peer
    return, but ``ncclCommAbort`` first waits for kernels already queued
    behind other GPU work, so the thread that gives up on a collective must
    not wait for it.
    """
    if backend != "nccl":
        _abort(pg)
        return
    threading.Thread(target=_abort, args=(pg,), name="shardkit-nccl-abort", daemon=True).start()


def _abort(pg) -> None:
    # The NCCL backend first and by itself: the wrapper's abort may stop at another backend's error.
    for target in (_nccl_backend(pg), pg):
        if target is None:
            continue
        try:
            target.abort()
        except Exception:  # noqa: BLE001 - a backend without abort, or one already gone
            pass


def init_default_group(store, rank: int, size: int, backend: str, timeout: timedelta):
    """Initialise torch's default process group on ``store`` and return it."""
    torch_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
    dist.init_process_group(torch_backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return dist.group.WORLD

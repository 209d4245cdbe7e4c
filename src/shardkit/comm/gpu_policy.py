"""The GPU-tensor rule: NCCL path, opt-in host round-trip, or an error.

CUDA tensors on an NCCL group run natively. On any other group the call raises
:class:`~shardkit.errors.UnsupportedOpError` naming ``SHARDKIT_ENABLE_GPU_FALLBACK``,
unless that variable is set (read at every call), in which case the tensors go
to the host, the collective runs there, the results are copied back, and every
such call warns with :class:`GpuFallbackWarning`. This module moves no bytes
itself except in :func:`host_round_trip`.

Example::

    route = choose_route([t.device for t in tensors], group.backend, "all_reduce_")
    # "native" or "host"; or UnsupportedOpError
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence

import torch

from shardkit.errors import CommArgumentError, UnsupportedOpError

__all__ = ["FALLBACK_ENV", "GpuFallbackWarning", "choose_route", "fallback_enabled",
           "host_round_trip", "warn_fallback"]

FALLBACK_ENV = "SHARDKIT_ENABLE_GPU_FALLBACK"
_FALSE = {"", "0", "false", "no", "off"}


class GpuFallbackWarning(UserWarning):
    """A collective on CUDA tensors went through host memory (slow); emitted on every such call."""


def fallback_enabled() -> bool:
    """True when ``SHARDKIT_ENABLE_GPU_FALLBACK`` is set to anything but 0/false/no/off."""
    return os.environ.get(FALLBACK_ENV, "").strip().lower() not in _FALSE


def choose_route(devices: Sequence[torch.device], backend: str, op_name: str) -> str:
    """``"native"`` or ``"host"`` for tensors on ``devices``; raise where neither applies."""
    kinds = {d.type if isinstance(d, torch.device) else torch.device(d).type for d in devices}
    if len(kinds) > 1:
        raise CommArgumentError(
            f"{op_name}: tensors are on mixed device types {sorted(kinds)}; "
            "pass tensors that are all on the CPU or all on CUDA"
        )
    if kinds <= {"cpu"}:
        return "native"
    if kinds == {"cuda"}:
        if backend == "nccl":
            return "native"
        if fallback_enabled():
            return "host"
        raise UnsupportedOpError(
            f"{op_name}: CUDA tensors on a {backend!r} group are not supported. "
            f"Create the group with backend='nccl', or set {FALLBACK_ENV}=1 to copy "
            "them through host memory (slow, warns on every call)."
        )
    raise UnsupportedOpError(
        f"{op_name}: tensors on device type {kinds.pop()!r} are not supported; "
        "use CPU tensors (Gloo) or CUDA tensors (NCCL)"
    )


def warn_fallback(op_name: str) -> None:
    """Emit the per-call :class:`GpuFallbackWarning` for ``op_name``, blamed on the caller's line."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("shardkit.comm"):
        frame = frame.f_back
    # warn_explicit with a fresh registry: Python's default "once per call
    # site" bookkeeping would hide every call after the first, and this rule
    # must warn on each one. A user's "ignore" filter still applies.
    warnings.warn_explicit(
        f"{op_name}: CUDA tensors went through host memory because {FALLBACK_ENV} is set; "
        "this is slow. Use an NCCL group, or unset the variable to make this an error.",
        GpuFallbackWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=None,
        module_globals=frame.f_globals,
    )


def host_round_trip(tensors: Sequence[torch.Tensor], op_name: str, run: Callable[[list], None],
                    written: Sequence[int] | None = None) -> None:
    """Copy ``tensors`` to the host, ``run`` the collective on the copies, copy back, warn.

    ``written``: the indices of the tensors the collective writes (default: all);
    only those are copied back, so an input is never written (nor needs to be writable).
    """
    warn_fallback(op_name)
    host = [t.detach().to("cpu", copy=True) for t in tensors]
    run(host)
    for i in range(len(tensors)) if written is None else written:
        tensors[i].detach().copy_(host[i], non_blocking=False)

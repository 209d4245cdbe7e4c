"""Linux libc functions through ctypes, found once: what the kernel offers that Python's os module lacks.

Example::

    mincore = linux_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    if mincore is not None: ...
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["linux_function"]


def linux_function(name: str, argtypes: list, restype=ctypes.c_int):
    """libc's ``name`` on Linux with ``argtypes`` and ``restype`` set (``use_errno``: read the error with
    ``ctypes.get_errno()``), else None (another platform, or a libc without it). Looked up among the
    process's own symbols, so no ``ldconfig`` run is needed. A ctypes call releases the GIL while it runs."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn

"""C library functions through ctypes, found once: what Python's os module lacks (Linux system calls
such as ``madvise``) and plain libc routines (``memcmp``).

Example::

    mincore = linux_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
    if mincore is not None: ...
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["libc_function", "linux_function"]


def libc_function(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's ``name`` with ``argtypes`` and ``restype`` set (``use_errno``: read the error with
    ``ctypes.get_errno()``), else None (a platform without the process's own symbols, or a libc without
    it). Looked up among the process's own symbols, so no ``ldconfig`` run is needed. A ctypes call
    releases the GIL while it runs."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def linux_function(name: str, argtypes: list, restype=ctypes.c_int):
    """:func:`libc_function` on Linux, else None (a Linux system call elsewhere is another one, or none)."""
    return libc_function(name, argtypes, restype) if sys.platform.startswith("linux") else None

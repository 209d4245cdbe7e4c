"""Copy (or compare) bytes between two addresses of host memory, bypassing the cache when that is faster.

Staging a checkpoint copies gigabytes that nobody reads right after. With
the optional C extension ``shardkit._stream_copy`` (built at install when a
compiler is there) copies of at least ``knobs.STREAM_COPY_MIN_BYTES`` use
non-temporal stores: on the 2-core benchmark machine, 2 GiB in 8 MiB chunks
on two threads took 0.12 s against 0.18 s with ``memmove``. Without the
extension, or for small or overlapping copies, this is ``ctypes.memmove``.
Both release the GIL. :func:`copy_and_hash` also feeds the copied bytes to a
block hasher in the same pass (a verified load); :func:`equal_at` compares
two ranges with libc's ``memcmp`` (an incremental save's proof). This module
moves and compares bytes only; it knows no tensors.

Example::

    copy_bytes(dst.data_ptr(), src.data_ptr(), src.nbytes)
"""

from __future__ import annotations

import ctypes

import numpy as np

from shardkit import knobs
from shardkit.storage.fast_io.libc import libc_function

try:
    from shardkit import _stream_copy
except ImportError:  # built without a C compiler: memmove only
    _stream_copy = None

__all__ = ["buffer_address", "copy_and_hash", "copy_bytes", "copy_kind", "equal_at"]

_MEMCMP = libc_function("memcmp", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])


def equal_at(a: int, b: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` at addresses ``a`` and ``b`` (host memory the caller keeps alive) are equal:
    libc's ``memcmp`` (the GIL released), else a comparison of copies where no C library is found.

    >>> x, y = bytearray(b"abcd"), bytearray(b"abcd")
    >>> equal_at(buffer_address(memoryview(x)), buffer_address(memoryview(y)), 4)
    True
    """
    if _MEMCMP is not None:
        return _MEMCMP(a, b, nbytes) == 0
    return ctypes.string_at(a, nbytes) == ctypes.string_at(b, nbytes)


def copy_bytes(dst_addr: int, src_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_addr`` to ``dst_addr`` (both host memory the caller owns)."""
    if nbytes <= 0:
        return
    if _streams(dst_addr, src_addr, nbytes) and nbytes >= knobs.STREAM_COPY_MIN_BYTES:
        _stream_copy.copy(dst_addr, src_addr, nbytes)
    else:
        ctypes.memmove(dst_addr, src_addr, nbytes)


def copy_and_hash(dst_addr: int, src: memoryview, hasher) -> None:
    """Copy the bytes of ``src`` (a flat byte view) to ``dst_addr`` and feed them to ``hasher``, in one pass.

    With the extension's hasher (``storage.checksum.new_block_hasher``) one
    C call copies and hashes, the GIL released: with AVX2 each 64-byte stripe
    is loaded once, hashed and streamed to ``dst_addr`` (an in-place 1 GiB
    load on the 2-core VM went from 1.15-1.32x the unverified one's time to
    1.03-1.12x); without AVX2, L2-sized strides are copied, then hashed.
    Otherwise (an ``xxhash`` hasher, no extension, ``knobs.STREAM_COPY`` off,
    overlapping memory) slices of ``knobs.HASH_SLICE_BYTES`` are copied, then
    hashed from ``src`` while they are still in the cache. It does not check the digest.

    Example::

        hasher = new_block_hasher()
        copy_and_hash(out.data_ptr(), memoryview(page_cache_map)[start:stop], hasher)
    """
    nbytes = src.nbytes
    if nbytes == 0:
        return
    src_addr = buffer_address(src)
    fused = getattr(hasher, "copy_update", None)
    if fused is not None and _streams(dst_addr, src_addr, nbytes):
        fused(dst_addr, src_addr, nbytes)
        return
    step = max(1, knobs.HASH_SLICE_BYTES)
    for start in range(0, nbytes, step):
        n = min(step, nbytes - start)
        copy_bytes(dst_addr + start, src_addr + start, n)
        hasher.update(src[start:start + n])


def _streams(dst_addr: int, src_addr: int, nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` may use the extension's streaming stores (built, on, no overlap)."""
    overlap = dst_addr < src_addr + nbytes and src_addr < dst_addr + nbytes
    return _stream_copy is not None and knobs.STREAM_COPY and not overlap


def buffer_address(buffer) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too), for ``copy_bytes``.

    The address is valid only while ``buffer`` is alive and not resized.
    """
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def copy_kind() -> str:
    """Which copy large staging copies use here, e.g. ``"avx2 streaming stores"`` or ``"memmove"``."""
    if _stream_copy is None or not knobs.STREAM_COPY:
        return "memmove"
    return _stream_copy.kind()

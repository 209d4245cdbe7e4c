"""Block checksums for data files.

A data file is cut into blocks of ``block_bytes`` (at file offsets that are
multiples of it); each block gets an xxh3-64 digest, and the file's checksum is
the xxh3-64 of the concatenated block digests (named ``xxh3_64_blocks``). Blocks
let a reader verify just the part of a file it reads; the file checksum lets a
validator compare one value. This module hashes memory only; it opens no file.

Example::

    hasher = BlockHasher(block_bytes=8 << 20)
    hasher.update(memoryview(b"header"))
    hasher.update(memoryview(tensor_bytes))
    record = hasher.finish()           # FileRecord(bytes=..., checksum="xxh3_64_blocks:...", ...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import xxhash

from shardkit import knobs
from shardkit.errors import ChecksumError, MetadataError
from shardkit.storage.json_io import expect_int, short_repr

try:
    from shardkit._stream_copy import Xxh3 as _Xxh3
except ImportError:  # built without a C compiler: the xxhash package's hasher
    _Xxh3 = None

__all__ = ["ALGORITHM", "FileRecord", "BlockHasher", "block_digest", "combine_block_digests", "new_block_hasher"]

ALGORITHM = "xxh3_64_blocks"

#: ``holds(start, stop)``: what a file's bytes ``start..stop`` hold, for an error message ("tensor 'w'").
Holds = Optional[Callable[[int, int], str]]


def _check_digest(value: object, what: str) -> None:
    if not (isinstance(value, str) and _DIGEST.fullmatch(value)):
        raise MetadataError(f"{what} is {short_repr(value)}, expected 16 hex digits (xxh3-64); the manifest "
                            f"is corrupt")


_DIGEST = re.compile("[0-9a-f]{16}")


def block_digest(data) -> str:
    """Hex xxh3-64 digest of one block's bytes (any buffer)."""
    return xxhash.xxh3_64_hexdigest(data)


def new_block_hasher():
    """A fresh xxh3-64 hasher (``.update(buffer)``, ``.hexdigest()``) for one block's bytes.

    The extension's ``shardkit._stream_copy.Xxh3`` where it was built (its
    ``copy_update`` lets ``storage.fast_io.memcopy.copy_and_hash`` copy and hash in
    one pass), else ``xxhash.xxh3_64()``. Both give the same digests; either
    may be fed from several threads, one update at a time.

    >>> h = new_block_hasher(); h.update(b"abc"); h.hexdigest() == block_digest(b"abc")
    True
    """
    return _Xxh3() if _Xxh3 is not None else xxhash.xxh3_64()


def combine_block_digests(block_checksums: list[str]) -> str:
    """The file checksum value for a list of block digests."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(''.join(block_checksums).encode())}"


@dataclass(frozen=True)
class FileRecord:
    """What a manifest records about one data file: its size and checksums.

    ``header_checksum`` (None in files written before it existed, and where
    the writer does not know the header) is the xxh3-64 of the file's bytes
    ``0 .. 8 + N``: the safetensors length prefix and header. A reader checks
    the header with it before trusting any offset in it, without hashing the
    whole first block (up to ``block_bytes`` of tensor data, or a download
    of that much on an object store); the blocks still verify every byte.
    """

    bytes: int
    checksum: str
    block_bytes: int
    block_checksums: list[str] = field(default_factory=list)
    header_checksum: str | None = None

    def to_json(self) -> dict:
        out = {
            "bytes": self.bytes,
            "checksum": self.checksum,
            "block_bytes": self.block_bytes,
            "block_checksums": list(self.block_checksums),
        }
        if self.header_checksum is not None:
            out["header_checksum"] = self.header_checksum
        return out

    @classmethod
    def from_json(cls, name: str, obj: object) -> "FileRecord":
        """Parse a manifest entry, raising :class:`MetadataError` on a malformed one.

        Every field is type-checked: ``bytes`` an int >= 0, ``block_bytes`` an
        int in ``1..knobs.MAX_CHECKSUM_BLOCK_BYTES``, ``checksum`` and each of
        ``block_checksums`` a 16-hex-digit xxh3-64 value, one block checksum per block, and
        ``header_checksum`` (optional) one too.
        """
        what = f"the manifest entry for file {short_repr(name)}"
        shape = "expected {bytes, checksum, block_bytes, block_checksums}"
        if not isinstance(obj, dict):
            raise MetadataError(f"{what} is {short_repr(obj)}; {shape}")
        size = expect_int(obj.get("bytes"), f"{what}: bytes")
        block_bytes = expect_int(obj.get("block_bytes"), f"{what}: block_bytes", low=1,
                                 high=knobs.MAX_CHECKSUM_BLOCK_BYTES)
        checksum = obj.get("checksum")
        if not isinstance(checksum, str) or not checksum.startswith(ALGORITHM + ":"):
            raise MetadataError(f"{what} has checksum {short_repr(checksum)}; this shardkit knows only "
                                f"{ALGORITHM}:<16 hex digits>")
        expected_blocks = -(-size // block_bytes)
        raw_blocks = obj.get("block_checksums")
        if not isinstance(raw_blocks, list) or len(raw_blocks) != expected_blocks:
            found = len(raw_blocks) if isinstance(raw_blocks, list) else short_repr(raw_blocks)
            raise MetadataError(f"{what}: {size} bytes in blocks of {block_bytes} need {expected_blocks} block "
                                f"checksums, the manifest has {found}; the manifest is corrupt")
        _check_digest(checksum[len(ALGORITHM) + 1:], f"{what}: checksum")
        for index, digest in enumerate(raw_blocks):
            _check_digest(digest, f"{what}: block_checksums[{index}]")
        header_checksum = obj.get("header_checksum")
        if header_checksum is not None:
            _check_digest(header_checksum, f"{what}: header_checksum")
        return cls(size, checksum, block_bytes, raw_blocks, header_checksum)

    def verify_header(self, data, *, file_name: str) -> None:
        """Raise :class:`ChecksumError` unless ``data`` (the file's bytes ``0 .. 8 + N``) is the header saved.

        Only for a record with a ``header_checksum`` (``ValueError`` otherwise: the caller verifies the
        first block instead).
        """
        if self.header_checksum is None:
            raise ValueError("this record has no header_checksum: verify block 0 instead")
        found = block_digest(data)
        if found != self.header_checksum:
            raise _corrupt(file_name, 0, len(data), "the file's header", self.header_checksum, found)

    def verify_block(self, index: int, data, *, file_name: str, holds: Holds = None) -> None:
        """Raise :class:`ChecksumError` unless ``data`` is block ``index`` as saved."""
        self.verify_digest(index, block_digest(data), len(data), file_name=file_name, holds=holds)

    def verify_views(self, index: int, views, *, file_name: str, holds: Holds = None) -> None:
        """Hash ``views`` (block ``index``'s bytes, in file order) and raise :class:`ChecksumError` unless they
        are that block as saved (through :meth:`verify_digest`, the comparison every verified read ends in).

        Hashed with :func:`new_block_hasher` (the extension releases the GIL
        for updates of 64 KiB and more, so threads hash blocks in parallel).

        >>> record.verify_views(3, [memoryview(mapped)[3 * bb:4 * bb]], file_name="rank_0.safetensors")
        """
        hasher = new_block_hasher()
        length = 0
        for view in views:
            hasher.update(view)
            length += len(view)
        self.verify_digest(index, hasher.hexdigest(), length, file_name=file_name, holds=holds)

    def verify_digest(self, index: int, found: str, length: int, *, file_name: str, holds: Holds = None) -> None:
        """Raise :class:`ChecksumError` unless ``found`` is the saved digest of block ``index`` (``length`` bytes).

        The message names the file, the block, its byte range, what those
        bytes hold (``holds(start, stop)``, called only on a mismatch, e.g.
        ``"tensor 'w'"``; None: not named) and how to go on.
        """
        if found != self.block_checksums[index]:
            start = index * self.block_bytes
            held = holds(start, start + length) if holds is not None else ""
            what = f"block {index}, {held}" if held else f"block {index}"
            raise _corrupt(file_name, start, start + length, what, self.block_checksums[index], found)


def _corrupt(file_name: str, start: int, stop: int, what: str, expected: str, found: str) -> ChecksumError:
    """The error for bytes ``start..stop`` of ``file_name`` (``what`` they are) that hash to ``found``, not ``expected``."""
    directory = file_name.rsplit("/", 1)[0] if "/" in file_name else "."
    return ChecksumError(
        f"{file_name}: bytes {start}..{stop} ({what}) do not match their checksum (expected {expected}, found "
        f"{found}); the file is corrupt. Run `shardkit validate {directory}` to list every damaged file, then "
        f"restore it from a copy or load an earlier checkpoint."
    )


class BlockHasher:
    """Streams bytes in and produces the :class:`FileRecord` for them."""

    def __init__(self, block_bytes: int):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self._total = 0
        self._filled = 0
        self._current = new_block_hasher()
        self._digests: list[str] = []

    def update(self, data) -> None:
        """Add ``data`` (a buffer) at the end of the stream."""
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_bytes - self._filled)
            if take == self.block_bytes:
                self._digests.append(block_digest(view[:take]))   # whole block: one call
            else:
                self._current.update(view[:take])
                self._filled += take
                if self._filled == self.block_bytes:
                    self._close_block()
            self._total += take
            view = view[take:]

    def _close_block(self) -> None:
        self._digests.append(self._current.hexdigest())
        self._current = new_block_hasher()
        self._filled = 0

    def finish(self) -> FileRecord:
        if self._filled:
            self._close_block()
        return FileRecord(self._total, combine_block_digests(self._digests), self.block_bytes, self._digests)

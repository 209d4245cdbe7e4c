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

from dataclasses import dataclass, field

import xxhash

from shardkit.errors import ChecksumError, MetadataError

__all__ = ["ALGORITHM", "FileRecord", "BlockHasher", "block_digest", "combine_block_digests"]

ALGORITHM = "xxh3_64_blocks"


def block_digest(data) -> str:
    """Hex xxh3-64 digest of one block's bytes (any buffer)."""
    return xxhash.xxh3_64_hexdigest(data)


def combine_block_digests(block_checksums: list[str]) -> str:
    """The file checksum value for a list of block digests."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(''.join(block_checksums).encode())}"


@dataclass(frozen=True)
class FileRecord:
    """What a manifest records about one data file: its size and checksums."""

    bytes: int
    checksum: str
    block_bytes: int
    block_checksums: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "bytes": self.bytes,
            "checksum": self.checksum,
            "block_bytes": self.block_bytes,
            "block_checksums": list(self.block_checksums),
        }

    @classmethod
    def from_json(cls, name: str, obj: object) -> "FileRecord":
        """Parse a manifest entry, raising :class:`MetadataError` on a malformed one."""
        try:
            record = cls(
                bytes=int(obj["bytes"]),
                checksum=str(obj["checksum"]),
                block_bytes=int(obj["block_bytes"]),
                block_checksums=[str(c) for c in obj["block_checksums"]],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MetadataError(
                f"the entry for file {name!r} in the manifest is malformed ({e!r}); expected "
                f"{{bytes, checksum, block_bytes, block_checksums}}"
            ) from e
        if not record.checksum.startswith(ALGORITHM + ":"):
            raise MetadataError(
                f"file {name!r} has checksum {record.checksum!r}; this shardkit knows only {ALGORITHM}"
            )
        expected_blocks = -(-record.bytes // record.block_bytes) if record.block_bytes > 0 else -1
        if expected_blocks != len(record.block_checksums):
            raise MetadataError(
                f"file {name!r}: {record.bytes} bytes in blocks of {record.block_bytes} need "
                f"{expected_blocks} block checksums, the manifest has {len(record.block_checksums)}"
            )
        return record

    def verify_block(self, index: int, data, *, file_name: str) -> None:
        """Raise :class:`ChecksumError` unless ``data`` is block ``index`` as saved."""
        found = block_digest(data)
        if found != self.block_checksums[index]:
            start = index * self.block_bytes
            raise ChecksumError(
                f"{file_name}: bytes {start}..{start + len(data)} do not match their checksum "
                f"(expected {self.block_checksums[index]}, found {found}); the file is corrupt. "
                f"Restore it from a copy, or load an earlier checkpoint."
            )


class BlockHasher:
    """Streams bytes in and produces the :class:`FileRecord` for them."""

    def __init__(self, block_bytes: int):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self._total = 0
        self._filled = 0
        self._current = xxhash.xxh3_64()
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
        self._current = xxhash.xxh3_64()
        self._filled = 0

    def finish(self) -> FileRecord:
        if self._filled:
            self._close_block()
        return FileRecord(self._total, combine_block_digests(self._digests), self.block_bytes, self._digests)

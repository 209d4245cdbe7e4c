"""Tensor bytes from safetensors files into caller-owned memory or private maps, verified by block.

:func:`read_ranges` fills caller-owned buffers at given file offsets;
:func:`map_verified` returns private (copy-on-write) maps of byte ranges of
a local file. Both verify every checksum block the bytes they return lie in
when a :class:`FileRecord` is given, through one check
(``FileRecord.verify_views`` / ``verify_digest``). This module moves bytes;
it does not decide which bytes a rank needs (that is the checkpoint
planner's job). Writing is in ``writer.py``.

Example::

    with store.open_reader(path) as r:
        header = read_header(r)
        out = torch.empty(header.tensors["w"].shape, dtype=w.dtype)
        read_ranges(r, [(header.tensors["w"].begin, byte_view(out))], record, holds=holds_of(header))
        [w_bytes] = map_verified(r, [(header.tensors["w"].begin, out.nbytes)], record)
"""

from __future__ import annotations

import functools
import threading

import torch

from shardkit import knobs
from shardkit.storage.backends.base import Reader
from shardkit.storage.checksum import FileRecord, Holds, new_block_hasher
from shardkit.storage.fast_io.parallel import run_parallel

__all__ = ["ExtraReads", "byte_view", "holds_of", "map_verified", "read_ranges"]

#: Blocks a mapped load hashes are handed to the I/O threads in jobs of about this many bytes.
_HASH_JOB_BYTES = 64 * 1024 * 1024


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat ``uint8`` memoryview over a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_ranges(reader: Reader, reads: list[tuple[int, memoryview]], record: FileRecord | None = None, *,
                holds: Holds = None, extra: "ExtraReads | None" = None) -> None:
    """Fill each ``(file_offset, buffer)`` in ``reads`` from the file.

    With ``record``, every checksum block that a read touches is verified
    (raising :class:`~shardkit.errors.ChecksumError`), never skipped: a block
    that lies wholly inside one buffer is read straight into it, each
    cache-sized slice hashed right as it is copied (``Reader.read_into_hashed``:
    no second pass, no extra copy). A block the reads cover only in part is
    still verified whole: the bytes no read wants are read from the file and
    hashed but not kept (``Reader.hash_range``: straight from the page-cache
    map for local files, else through a scratch buffer of at most
    ``knobs.HASH_SLICE_BYTES``), so at most one block's extra bytes at each
    end of a read are hashed, none copied. Where extra bytes cost a download
    (``reader.extra_reads_are_cheap`` is False: object stores), the blocks
    the reads cover whole are verified (a stretch of such blocks in one
    gather read, as an unverified read fetches them); a block they cover
    only in part is downloaded whole in one request and verified before its
    wanted parts are copied out when ``extra`` (the load's
    :class:`ExtraReads` allowance) still has the bytes the reads do not
    want, else read unverified, so a rank fetches at most its allowance
    more than it needs (``validate_distributed`` hashes every byte). One
    sweep over the blocks in file order keeps the work linear in blocks +
    reads. On a mismatch, buffers may already hold the block's unverified
    bytes; the error names what the block holds when ``holds``
    (:func:`holds_of`) is given.
    """
    reads = [(offset, buf.cast("B") if buf.format != "B" else buf) for offset, buf in reads if len(buf)]
    if record is None:
        if reader.extra_reads_are_cheap:
            for offset, buf in reads:
                _read_chunked(reader, offset, buf)
        else:  # each run of adjacent reads is one gather read: one request per part, not per tensor
            for offset, views in _runs(sorted(reads, key=lambda r: r[0])):
                reader.read_into_views(offset, views)
        return
    _check_size(reader, record)
    for offset, buf in reads:  # the block walk clips blocks to the file: a read past its end would go short silently
        reader.check_inside(offset, len(buf))
    reads.sort(key=lambda r: r[0])
    if not reader.extra_reads_are_cheap:
        _read_remote_verified(reader, record, reads, holds, extra)
        return
    for block, start, stop, active in _blocks_with_reads(reads, record):
        _read_block(reader, record, block, start, stop, active, holds)


def map_verified(reader: Reader, spans: list[tuple[int, int]], record: FileRecord | None, *,
                 holds: Holds = None) -> list[memoryview | None]:
    """Each ``(file_offset, nbytes)`` of ``spans`` as a private (copy-on-write) map of the file, verified first.

    One view per span (``Reader.map_range``: nothing copied, pages shared
    with the page cache until written, writes never reach the file), or None
    where the reader cannot map it (the caller reads it instead). With
    ``record``, every checksum block a mapped span touches is hashed whole
    before this returns, by the block walk :func:`read_ranges` uses: the
    spans' bytes from their own maps (the hash is also their pages' first
    touch, which the caller's first touch would have paid), the rest of a
    block (bytes of tensors not asked for, the header) from the file
    (``Reader.hash_range``: the page cache, not kept), each block once
    however many spans share it, in windows of whole blocks spread over the
    I/O threads. A corrupt byte raises :class:`~shardkit.errors.ChecksumError`
    and no view is returned, so a caller never holds a mapped byte that was
    not verified. What it does not cover: a file changed in place after this
    returns shows through the maps, as through any map (shardkit's saves
    replace files by rename, never in place). Without ``record`` it only maps.

    >>> [w] = map_verified(reader, [(entry.begin, entry.nbytes)], record)
    """
    if record is not None:
        _check_size(reader, record)
        for offset, nbytes in spans:
            reader.check_inside(offset, nbytes)
    views = [reader.map_range(offset, nbytes) for offset, nbytes in spans]
    if record is None:
        return views
    mapped = sorted(((offset, view) for (offset, _), view in zip(spans, views) if view is not None),
                    key=lambda r: r[0])
    window = -(-_HASH_JOB_BYTES // record.block_bytes) * record.block_bytes
    run_parallel([functools.partial(_hash_mapped, reader, record, part, holds) for part in _windows(mapped, window)])
    return views


def _hash_mapped(reader: Reader, record: FileRecord, mapped: list[tuple[int, memoryview]], holds: Holds) -> None:
    """Verify every block the (offset-sorted) mapped views touch, hashing the views in place."""
    for block, start, stop, active in _blocks_with_reads(mapped, record):
        _read_block(reader, record, block, start, stop, active, holds, mapped=True)


def _windows(reads: list[tuple[int, memoryview]], window: int) -> list[list[tuple[int, memoryview]]]:
    """The (offset-sorted) reads cut at file offsets that are multiples of ``window`` (whole blocks), grouped
    by window in file order: no block is in two groups."""
    groups: dict[int, list[tuple[int, memoryview]]] = {}
    for offset, view in reads:
        cuts = range(window - offset % window, len(view), window)
        for lo, hi in zip([0, *cuts], [*cuts, len(view)]):
            groups.setdefault((offset + lo) // window, []).append((offset + lo, view[lo:hi]))
    return [groups[w] for w in sorted(groups)]


def holds_of(header) -> Holds:
    """A ``holds`` for :func:`read_ranges` / :func:`map_verified` errors: the tensors of ``header`` (a
    ``SafetensorsHeader``) whose bytes a range overlaps, and the header itself where it does."""
    def holds(start: int, stop: int) -> str:
        names = [name for name, entry in header.tensors.items() if entry.begin < stop and entry.end > start]
        parts = ["the file's header"] if start < header.data_start else []
        if names:
            shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            parts.append(f"tensor{'s' if len(names) > 1 else ''} {shown}")
        return " and ".join(parts)
    return holds


def _blocks_with_reads(reads: list[tuple[int, memoryview]], record: FileRecord):
    """``(block, start, stop, reads touching it)`` for each block the (offset-sorted) reads touch, in file order."""
    active: list[tuple[int, memoryview]] = []
    next_read = 0
    for block in _touched_blocks(reads, record.block_bytes):
        start = block * record.block_bytes
        stop = min(start + record.block_bytes, record.bytes)
        while next_read < len(reads) and reads[next_read][0] < stop:
            active.append(reads[next_read])
            next_read += 1
        active = [(off, buf) for off, buf in active if off + len(buf) > start]
        yield block, start, stop, active


def _read_remote_verified(reader: Reader, record: FileRecord, reads: list[tuple[int, memoryview]], holds: Holds,
                          extra: "ExtraReads | None") -> None:
    """Verified reads where every byte fetched is a download (``read_ranges``' rules, fewer requests).

    Consecutive blocks that the reads tile exactly (no gap, no overlap) are
    fetched as one gather read of up to ``OBJECT_PART_BYTES x
    OBJECT_PARTS_IN_FLIGHT`` bytes, its parts in flight at once as an
    unverified read's are; each block is hashed from the buffers once that
    stretch has arrived (a download costs far more than this second pass over
    memory just written). A block covered only in part is fetched whole and
    verified while ``extra`` allows (:func:`_fetch_block_verified`), else read
    unverified; a block two reads overlap in is read on its own.
    """
    stretch_bytes = max(record.block_bytes, knobs.OBJECT_PART_BYTES * max(1, knobs.OBJECT_PARTS_IN_FLIGHT))
    stretch: list[tuple[int, int, list[memoryview]]] = []  # (block, start, its views), consecutive blocks
    for block, start, stop, active in _blocks_with_reads(reads, record):
        views = _tiling_views(active, start, stop)
        joins = (views is not None and stretch and stretch[-1][0] == block - 1
                 and stop - stretch[0][1] <= stretch_bytes)
        if stretch and not joins:
            _fetch_and_verify(reader, record, stretch, holds)
            stretch = []
        if views is not None:
            stretch.append((block, start, views))
        elif _covered(active, start, stop):
            _read_block(reader, record, block, start, stop, active, holds)
        elif extra is not None and extra.take(stop - start - _wanted_in(active, start, stop)):
            _fetch_block_verified(reader, record, block, start, stop, active, holds)
        else:
            _read_unverified(reader, start, stop, active)
    if stretch:
        _fetch_and_verify(reader, record, stretch, holds)


def _tiling_views(active: list[tuple[int, memoryview]], start: int, stop: int) -> list[memoryview] | None:
    """The reads' views of ``[start, stop)`` in file order when they tile it exactly, else None."""
    runs = _runs(_clipped(active, start, stop))
    if len(runs) == 1 and runs[0][0] == start and sum(len(v) for v in runs[0][1]) == stop - start:
        return runs[0][1]
    return None


def _fetch_and_verify(reader: Reader, record: FileRecord, stretch: list[tuple[int, int, list[memoryview]]],
                      holds: Holds) -> None:
    """One gather read of consecutive tiled blocks, then each block's digest checked."""
    reader.read_into_views(stretch[0][1], [view for _, _, views in stretch for view in views])
    for block, _start, views in stretch:
        record.verify_views(block, views, file_name=reader.name, holds=holds)


def _fetch_block_verified(reader: Reader, record: FileRecord, block: int, start: int, stop: int,
                          active: list[tuple[int, memoryview]], holds: Holds) -> None:
    """Download block ``[start, stop)`` whole in one request, verify it, then copy out the parts the reads want."""
    scratch = memoryview(bytearray(stop - start))
    reader.read_into(start, scratch)
    record.verify_views(block, [scratch], file_name=reader.name, holds=holds)
    for lo, view in _clipped(active, start, stop):
        view[:] = scratch[lo - start:lo - start + len(view)]


def _wanted_in(active: list[tuple[int, memoryview]], start: int, stop: int) -> int:
    """How many bytes of ``[start, stop)`` the (offset-sorted) reads want, each byte once."""
    wanted, position = 0, start
    for lo, view in _clipped(active, start, stop):
        hi = lo + len(view)
        if hi > position:
            wanted += hi - max(lo, position)
            position = hi
    return wanted


class ExtraReads:
    """A load's allowance of bytes to download beyond those it wants, spent verifying partly read blocks.

    On an object store a block a rank reads only in part can be verified
    only by downloading the rest of it. :meth:`for_load` allows
    ``knobs.VERIFY_EXTRA_READ_FRACTION`` (0.1) of the bytes the load wants,
    so a verified load downloads at most 1.1x its bytes; the blocks the
    allowance does not reach are read unverified. Shared by the load's
    threads (a lock); local files never spend it (their extra bytes are free).

    >>> extra = ExtraReads.for_load(1 << 30); extra.take(8 << 20)
    True
    """

    def __init__(self, nbytes: int):
        self._left = max(0, int(nbytes))
        self._lock = threading.Lock()

    @classmethod
    def for_load(cls, wanted_bytes: int) -> "ExtraReads":
        return cls(int(wanted_bytes * max(0.0, knobs.VERIFY_EXTRA_READ_FRACTION)))

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` if that many are left (True), else spend nothing (False)."""
        with self._lock:
            if nbytes > self._left:
                return False
            self._left -= nbytes
            return True


def _covered(active: list[tuple[int, memoryview]], start: int, stop: int) -> bool:
    """Whether the reads in ``active`` (sorted by offset) cover ``[start, stop)`` entirely."""
    position = start
    for offset, buf in active:
        if offset > position:
            return False
        position = max(position, offset + len(buf))
        if position >= stop:
            return True
    return position >= stop


def _read_unverified(reader: Reader, start: int, stop: int, active: list[tuple[int, memoryview]]) -> None:
    for lo, views in _runs(_clipped(active, start, stop)):
        reader.read_into_views(lo, views)


def _clipped(active: list[tuple[int, memoryview]], start: int, stop: int) -> list[tuple[int, memoryview]]:
    """The parts of the (offset-sorted) reads that fall in ``[start, stop)``, as ``(file_offset, view)``."""
    out = []
    for offset, buf in active:
        lo, hi = max(start, offset), min(stop, offset + len(buf))
        if lo < hi:
            out.append((lo, buf[lo - offset:hi - offset]))
    return out


def _runs(pieces: list[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Offset-sorted ``(file_offset, view)`` pieces grouped into runs that each tile one contiguous range.

    A piece that starts where the previous one ended joins its run; any gap or
    overlap starts a new run (a gap is never read, an overlap is read twice).
    """
    runs: list[tuple[int, list[memoryview]]] = []
    end = None
    for offset, view in pieces:
        if offset == end:
            runs[-1][1].append(view)
        else:
            runs.append((offset, [view]))
        end = offset + len(view)
    return runs


def _touched_blocks(reads: list[tuple[int, memoryview]], block_bytes: int):
    """Indices of the blocks the (offset-sorted) reads touch, ascending, each once."""
    last = -1
    for offset, buf in reads:
        for block in range(max(last + 1, offset // block_bytes), (offset + len(buf) - 1) // block_bytes + 1):
            yield block
            last = block


def _read_chunked(reader: Reader, offset: int, buf: memoryview) -> None:
    step = knobs.IO_CHUNK_BYTES
    for start in range(0, len(buf), step):
        reader.read_into(offset + start, buf[start : start + step])


def _check_size(reader: Reader, record: FileRecord) -> None:
    if reader.size_bytes != record.bytes:
        from shardkit.errors import IncompleteCheckpointError

        raise IncompleteCheckpointError(
            f"{reader.name} is {reader.size_bytes} bytes, the manifest records {record.bytes}; "
            f"the file was truncated or replaced after the save"
        )


def _read_block(reader: Reader, record: FileRecord, block: int, start: int, stop: int,
                active: list[tuple[int, memoryview]], holds: Holds = None, *, mapped: bool = False) -> None:
    """Read the active reads' parts of one block, hashing the whole block as it goes, in file order.

    Covered bytes are read straight into their buffers (hashed slice by slice
    while hot), or, with ``mapped`` (the buffers are maps of the file that
    already hold its bytes), hashed where they are; bytes of the block no
    read wants are hashed from the file without being kept
    (``Reader.hash_range``: from the page-cache map for local files). Bytes
    two reads both want are hashed once.
    """
    hasher = new_block_hasher()
    position = start
    for offset, buf in sorted(active, key=lambda r: r[0]):
        lo, hi = max(start, offset), min(stop, offset + len(buf))
        if lo >= hi:
            continue
        if lo > position:
            reader.hash_range(position, lo - position, hasher)
        elif lo < position and not mapped:  # overlaps an earlier read: those bytes are hashed already
            reader.read_into(lo, buf[lo - offset:min(hi, position) - offset])
        if hi > position:
            fresh = max(lo, position)
            if mapped:
                hasher.update(buf[fresh - offset:hi - offset])
            else:
                reader.read_into_hashed(fresh, buf[fresh - offset:hi - offset], hasher)
            position = hi
    if position < stop:
        reader.hash_range(position, stop - position, hasher)
    record.verify_digest(block, hasher.hexdigest(), stop - start, file_name=reader.name, holds=holds)

"""Prove, byte for byte, which tensors equal a range of a base file: the comparison engine of incremental saves.

Given candidates (a tensor, and the reader and byte range of the base file
said to hold the same bytes), :class:`ByteProof` answers which candidates
are *equal*: every byte of the tensor equals the byte at the same place of
the file. Nothing weaker counts (no hash, no version counter). It goes in
two steps so that a writer can start early:

1. :meth:`ByteProof.probe` compares the first ``FIRST_PIECE_BYTES`` of each
   candidate (and, where ``digest_first``, first checks one whole checksum
   block of the base against its recorded digest: a differing digest proves
   a difference without reading the base). What differs there is
   :meth:`~ByteProof.changed` at once; a tensor updated by training usually
   is.
2. :meth:`ByteProof.jobs` cuts the rest of the bytes of the remaining
   candidates into pieces of at most ``COMPARE_PIECE_BYTES`` and returns a
   few *lanes* for ``run_parallel``, each taking the next piece left from
   one shared queue (not one job per tensor: a few large tensors keep every
   lane busy, and a lane slowed down by another process takes fewer
   pieces); a candidate already found different is skipped. Each base file
   is mapped once (``Reader.map_range`` over the range its candidates span,
   no background read-ahead) and compared with libc's ``memcmp``, which
   releases the GIL; the pages fault in as it reads them (populating each
   piece first with ``MADV_POPULATE_READ``, or the map's background
   read-ahead, measured no faster on the 2-core VM, cached or not). A reader
   that cannot map (object stores) reads each piece into a scratch buffer of
   its lane instead.

What it does not do: decide which tensor to compare with which range
(``incremental.py``), write anything, or hash the tensors (the block digest
of ``digest_first`` only ever proves a difference).

Example::

    proof = ByteProof([Candidate("w", reader, 80, 4176, w, record)], digest_first=False)
    proof.probe()
    run_parallel(proof.jobs())
    proof.equal()        # [0] when every byte of w equals bytes 80..4176 of the file
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

from shardkit import knobs
from shardkit.storage import FileRecord, Reader, new_block_hasher, run_parallel
from shardkit.storage.fast_io.memcopy import buffer_address, equal_at

__all__ = ["Candidate", "ByteProof", "usable_cpus", "COMPARE_PIECE_BYTES", "FIRST_PIECE_BYTES"]

#: Bytes compared at a time: the unit of early exit, of a lane's turn and of a scratch read.
COMPARE_PIECE_BYTES = 16 * 1024 * 1024
#: What :meth:`ByteProof.probe` compares of each candidate: a changed tensor usually costs this, not its size.
FIRST_PIECE_BYTES = 64 * 1024


@dataclass
class Candidate:
    """``tensor``'s bytes, said to be at ``[begin, end)`` of the base file open in ``reader``."""

    name: str
    reader: Reader
    begin: int
    end: int
    tensor: torch.Tensor
    record: FileRecord | None = None     # the base file's record (its block digests, for ``digest_first``)
    flat: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        # The bytes a writer would write (``write_safetensors`` resolves conjugate and negative views too).
        t = self.tensor.detach().resolve_conj().resolve_neg().contiguous()
        self.flat = t.reshape(-1).view(torch.uint8)


class _Source:
    """Where a piece of one base file is read: a map of the range the candidates span, else ``read_into``."""

    def __init__(self, reader: Reader, lo: int, hi: int):
        self.reader, self.lo = reader, lo
        # no background read-ahead: a thread beside the lanes, measured no faster
        self.view = reader.map_range(lo, hi - lo, prefetch=False) if hi > lo else None
        self.address = buffer_address(self.view) if self.view is not None else 0

    def piece_address(self, offset: int, nbytes: int, scratch: list) -> int:
        """The address of file bytes ``[offset, offset + nbytes)``: in the map, else read
        into ``scratch[0]`` (a bytearray the job keeps, grown as needed)."""
        if self.view is not None:
            return self.address + offset - self.lo
        if scratch[0] is None or len(scratch[0]) < nbytes:
            scratch[0] = bytearray(max(nbytes, min(COMPARE_PIECE_BYTES, 1 << 20)))
        view = memoryview(scratch[0])[:nbytes]
        self.reader.read_into(offset, view)
        return buffer_address(view)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view, self.address = None, 0


class ByteProof:
    """Which of ``candidates`` hold exactly the bytes of their base range (see the module's docstring).

    ``digest_first``: check one whole checksum block's recorded digest before reading the base (object
    stores, where a read is a request). A candidate whose size differs from its range, or whose range
    passes the end of its file, is changed from the start."""

    def __init__(self, candidates: list[Candidate], *, digest_first: bool):
        self.candidates = candidates
        self.digest_first = digest_first
        self._differs = [c.flat.numel() != c.end - c.begin or c.end > c.reader.size_bytes or c.begin < 0
                         for c in candidates]
        spans: dict[int, list] = {}       # per reader: [reader, lowest begin, highest end] of its candidates
        for c, d in zip(candidates, self._differs):
            if not d:
                span = spans.setdefault(id(c.reader), [c.reader, c.begin, c.end])
                span[1], span[2] = min(span[1], c.begin), max(span[2], c.end)
        self._sources = {key: _Source(*span) for key, span in spans.items()}
        self._source_of = [None if d else self._sources[id(c.reader)] for c, d in zip(candidates, self._differs)]
        #: a base file is read, not mapped (object stores): a piece is a request, so lanes are I/O threads
        self.reads = any(source.view is None for source in self._sources.values())
        self._probed = False     # the first pieces are compared by probe() only: no proof without it

    def probe(self) -> None:
        """Compare each candidate's first ``FIRST_PIECE_BYTES`` (after its block digest, with ``digest_first``):
        inline where the base files are mapped, on the I/O threads where they are read."""
        todo = [i for i, d in enumerate(self._differs) if not d]
        taken = itertools.count()
        lanes = min(len(todo), max(1, knobs.IO_THREADS)) if self.reads else 1
        run_parallel([lambda: self._probe_lane(todo, taken) for _ in range(lanes)])
        self._probed = True

    def _probe_lane(self, todo: list[int], taken) -> None:
        scratch = [None]
        for k in taken:
            if k >= len(todo):
                return
            i = todo[k]
            c = self.candidates[i]
            if self.digest_first and c.record is not None and _block_differs(c):
                self._differs[i] = True
            else:
                self._compare(i, 0, min(FIRST_PIECE_BYTES, c.end - c.begin), scratch)

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(candidate index, start, bytes)`` of every piece :meth:`probe` left, in candidate order,
        each at most ``COMPARE_PIECE_BYTES``: together exactly ``[first piece, end)`` of each candidate."""
        out = []
        for i, c in enumerate(self.candidates):
            if self._differs[i]:
                continue
            size = c.end - c.begin
            out += [(i, start, min(COMPARE_PIECE_BYTES, size - start))
                    for start in range(min(FIRST_PIECE_BYTES, size), size, COMPARE_PIECE_BYTES)]
        return out

    def jobs(self, lanes: int | None = None) -> list:
        """``lanes`` callables that take the :meth:`pieces` from one shared queue, each the next one
        left, until none is: a lane slowed down (another process on its core) takes fewer pieces,
        and a difference found skips the rest of its candidate. Run them all (``run_parallel``)
        before asking :meth:`equal`. Default lanes: one per CPU this process may run on (the
        compare is bound by memory bandwidth; more lanes only take CPU from a writer beside them),
        at most ``knobs.IO_THREADS``; where a base file is read, not mapped (object stores: a piece
        is a request), ``knobs.IO_THREADS``."""
        pieces = self.pieces()
        if lanes is None:
            lanes = max(1, knobs.IO_THREADS) if self.reads else min(max(1, knobs.IO_THREADS), usable_cpus())
        taken = itertools.count()         # next() on a count is atomic under the GIL: each piece is taken once
        return [lambda: self._lane(pieces, taken) for _ in range(max(1, min(lanes, len(pieces))))]

    def _lane(self, pieces: list[tuple[int, int, int]], taken) -> None:
        scratch = [None]
        for k in taken:
            if k >= len(pieces):
                return
            i, start, n = pieces[k]
            if not self._differs[i]:        # another lane may have found a difference already
                self._compare(i, start, n, scratch)

    def _compare(self, i: int, start: int, n: int, scratch: list) -> None:
        if n <= 0:
            return
        c = self.candidates[i]
        ours = c.flat[start:start + n]
        if ours.device.type != "cpu":
            ours = ours.cpu()
        theirs = self._source_of[i].piece_address(c.begin + start, n, scratch)
        if not equal_at(theirs, ours.data_ptr(), n):
            self._differs[i] = True

    def changed(self) -> list[int]:
        """Indices of the candidates found different so far."""
        return [i for i, d in enumerate(self._differs) if d]

    def equal(self) -> list[int]:
        """Indices of the candidates proven equal (call once :meth:`probe` and every job have run;
        ``RuntimeError`` before :meth:`probe`: the first pieces would be unproven)."""
        if not self._probed:
            raise RuntimeError("ByteProof.equal() before probe(): the first piece of each candidate was "
                               "never compared")
        return [i for i, d in enumerate(self._differs) if not d]

    def close(self) -> None:
        """Drop the maps (the readers stay open: their owner closes them)."""
        for source in self._sources.values():
            source.close()


def _block_differs(c: Candidate) -> bool:
    """Whether the first whole checksum block of the base inside ``c``'s range hashes otherwise from its bytes."""
    record = c.record
    block = -(-c.begin // record.block_bytes)
    start = block * record.block_bytes
    if start + record.block_bytes > c.end or block >= len(record.block_checksums):
        return False
    hasher = new_block_hasher()
    ours = c.flat[start - c.begin:start - c.begin + record.block_bytes]
    hasher.update(memoryview((ours.cpu() if ours.device.type != "cpu" else ours).numpy()))
    return hasher.hexdigest() != record.block_checksums[block]


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the platform says, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)

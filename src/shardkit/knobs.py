"""Tunables, in one place.

Every number that trades speed for memory or safety lives here, so tests and
benchmarks can override it (``monkeypatch.setattr(knobs, "IO_CHUNK_BYTES", 64)``)
and nobody hunts for a constant. Read them at call time (``knobs.X``), never
copy them into a default argument.
"""

from __future__ import annotations

import os

#: Size of one read or write call when streaming tensor bytes to or from a file.
#: (8 MiB measured best for fsync'd saves on a 2-core box; 16 MiB was 5-10% slower.)
IO_CHUNK_BYTES: int = 8 * 1024 * 1024

#: While writing a file, ask the kernel to start writing it to disk every this
#: many bytes (Linux sync_file_range), so the final fsync finds little to do.
WRITEBACK_BYTES: int = 8 * 1024 * 1024

#: Checksum granularity for data files: each block of this many bytes gets its
#: own checksum, so a partial read can be verified without reading the file.
CHECKSUM_BLOCK_BYTES: int = 8 * 1024 * 1024

#: Largest safetensors JSON header we agree to parse (a hostile file could
#: claim 2**60 bytes).
MAX_SAFETENSORS_HEADER_BYTES: int = 100_000_000

#: Largest index / metadata JSON file we agree to read.
MAX_INDEX_BYTES: int = 10 * 1024 * 1024

#: Largest ``bytes`` / ``bytearray`` plain leaf a save keeps in ``metadata.json``
#: (as base64, 4/3 its size; the whole file must stay under ``MAX_INDEX_BYTES``).
#: Past it the save is refused, naming the leaf: store such bytes as a uint8 tensor.
MAX_BYTES_VALUE: int = 1 << 20

#: ``metadata.json`` (version 3) describes a tensor whose chunks form a regular grid as one compact
#: entry in saves of at least this many ranks; smaller saves list every chunk with its byte range (as
#: small there, and readable by eye). Tests set it to 1 to put every save through the compact path.
COMPACT_MIN_RANKS: int = 8

#: At most this many cells in all the grid entries of one ``metadata.json`` (4,096 ranks x 1,000
#: tensors is 2**22): a hostile file of a few bytes per grid cannot make a reader expand billions of chunks.
MAX_GRID_CELLS: int = 1 << 26

# --- limits on untrusted files (metadata.json, rank manifests, safetensors headers) ---------
# A file on disk may be damaged or hostile: these bound the work and memory that
# parsing and planning may spend on it (see ``storage.json_io``).

#: Deepest nesting of JSON arrays/objects accepted (checked before parsing, so a
#: deeply nested file never reaches Python's recursion limit). A nested state of
#: depth d needs about 3 * d levels in ``structure``.
MAX_JSON_DEPTH: int = 200

#: Longest number literal (characters) accepted in JSON: ints up to 40 digits, so
#: 64-bit sizes pass and a 5,000-digit integer is refused before ``int()`` runs.
MAX_JSON_NUMBER_CHARS: int = 40

#: Longest tensor, file or key name accepted from a manifest or header.
MAX_NAME_CHARS: int = 65536

#: Most dimensions a saved tensor may claim.
MAX_TENSOR_NDIM: int = 64

#: Largest dimension or byte count a manifest or header may claim (torch sizes are int64).
MAX_TENSOR_DIM: int = 2**63 - 1

#: Most ranks a checkpoint may claim to have been saved by.
MAX_NUM_RANKS: int = 1 << 20

#: Largest checksum block accepted from a manifest; hashing streams through
#: buffers of at most ``IO_CHUNK_BYTES`` whatever the block size.
MAX_CHECKSUM_BLOCK_BYTES: int = 1 << 30

#: Limits on a Hugging Face shard index or metrics file read from disk (names
#: are bounded by ``MAX_NAME_CHARS``; all
#: far above any real model: the largest HF indexes hold ~10k names of <200
#: characters). Past them the file is refused as corrupt or hostile.
MAX_INDEX_TENSORS: int = 1_000_000
MAX_METRICS: int = 10_000

#: What ``mmap="auto"`` (the default) means for ``shardkit.hf.load_checkpoint``:
#: True maps local safetensors files copy-on-write in dict mode and with
#: ``assign=True`` (zero-copy, as ``safetensors.torch.load_file`` does);
#: False reads every tensor into fresh memory.
HF_MMAP_LOADS: bool = True

#: Tensors over a map of a local file (the default HF dict load, ``assign=True``)
#: get their pages mapped ahead of first use by one background thread
#: (``madvise(MADV_POPULATE_READ)``, in chunks of ``MAP_PREFETCH_CHUNK_BYTES``),
#: and the map asks for large page-cache folios (``MADV_HUGEPAGE``); see
#: ``shardkit.storage.fast_io.map_prefetch``. False leaves every page to the first touch.
MAP_PREFETCH: bool = True
MAP_PREFETCH_CHUNK_BYTES: int = 32 * 1024 * 1024

#: Threads used to read files in parallel inside one process.
IO_THREADS: int = 4

#: Staging copies (``AsyncCheckpointer``) of at least this many bytes use
#: non-temporal stores when the ``shardkit._stream_copy`` extension is built
#: (see ``shardkit.storage.fast_io.memcopy``); ``STREAM_COPY = False`` turns that off.
STREAM_COPY: bool = True
STREAM_COPY_MIN_BYTES: int = 1024 * 1024

#: Staging into new buffers (a first ``save_async``) faults their pages in
#: with ``madvise(MADV_POPULATE_WRITE)`` on a helper job running ahead of the
#: copies (see ``shardkit.storage.fast_io.prefault``); False leaves the faults to the copies.
STAGING_PREFAULT: bool = True

#: A load's outputs allocated by the load (not ``out=``, not mapped) are faulted in with
#: ``madvise(MADV_POPULATE_WRITE)`` on the I/O threads before the reads fill
#: them (``checkpoint.loading.execute``); False leaves the faults to the copies.
LOAD_PREFAULT: bool = True

#: Only outputs of at least this many bytes. Smaller ones are mostly heap
#: memory glibc hands out again, already faulted in; from 1 MiB up a fresh
#: output is common (a restarted job's first load), and faulting it in bulk
#: pays: on the 2-core VM a fresh 1 GiB copying load of 8-64 MiB tensors took
#: 0.24-0.26 s against 0.30-0.31 s with only the 32 MiB+ ones prefaulted
#: (median of 21, two runs). Where the memory was already faulted in, the
#: populate call walks its pages for ~45 ms/GiB and changes no byte.
LOAD_PREFAULT_MIN_BYTES: int = 1024 * 1024

#: Local reads of at least this many bytes copy from a read-only map of the
#: file (non-temporal copies; see ``storage.backends.local._LocalReader``) instead of
#: ``preadv``. ``MMAP_READS = False`` reads everything with ``preadv``.
MMAP_READS: bool = True
MMAP_READ_MIN_BYTES: int = 1024 * 1024

#: A local file smaller than this (known before it is written) is written and
#: hashed inline by the calling thread, with plain writes made durable by the
#: publish's fsync: no thread start-ups, no ``O_DIRECT`` bounce buffers, which
#: cost more than the write for a few MiB (a rank's file of small tensors).
SMALL_FILE_BYTES: int = 4 * 1024 * 1024

#: Threads issuing positional writes into one local file. The hashing thread
#: runs beside them, so half the cores (at most 4) keeps both busy.
WRITE_THREADS: int = max(1, min(4, (os.cpu_count() or 2) // 2))

#: Durable local saves write with ``O_DIRECT`` through aligned bounce buffers
#: (``storage.fast_io.direct_io``), skipping the page cache; ``DIRECT_IO = False``
#: writes through the page cache with early writeback instead. Blocks of
#: ``DIRECT_IO_BLOCK_BYTES``, ``DIRECT_IO_QUEUE_DEPTH`` of them in flight
#: (measured on the 2-core VM: 16 MiB x 4 wrote 2 GiB in 1.1 s; 8 MiB x 1-4 in 1.3-1.7 s).
DIRECT_IO: bool = True
#: Background saves (``async_save``, ``CheckpointManager.save``) write with ``O_DIRECT`` like ``save``;
#: False writes them with the same C writer through the page cache (fsync'd at the end). Beside a tiny
#: Llama on 1 thread (``shardkit bench --only gil``, 300 MiB, 2-core VM, 2 runs of 5 saves) the page
#: cache slowed the steps in flight less (+20%, +27% against +34%, +32%) but the save lasted longer,
#: and more training time was lost per save (0.124, 0.126 s against 0.100, 0.085 s). It also leaves
#: the checkpoint in the page cache, where the next incremental save compares with it.
BACKGROUND_DIRECT_IO: bool = True
#: The share of the wall time a background save keeps the disk busy, in (0, 1]: below 1 its writer
#: writes one ``DIRECT_IO_BLOCK_BYTES`` block at a time and rests after each for (1 - share) / share
#: times as long as the write took, so it runs at that share of the disk's speed, whatever the disk
#: (``storage.fast_io.write_mode``); a blocking wait on the save (``wait()``, the manager's next
#: ``save``, ``close()``, the exit) lifts the pace. ``save`` is never paced. Writing at full speed
#: costs a training loop on the same machine CPU time per byte, all of it while the save runs. Beside
#: a tiny Llama on 1 thread (``shardkit bench --only gil``, 300 MiB, 2-core VM): at full speed the
#: steps in flight ran +15% to +36% slower (11 runs); at 0.25, +5%, -2%, +23%, +3%, +8%, and +9%, +11%
#: in two A/Bs against 0.1 (10 saves each, interleaved: 0.1 gave +0.6%, +0.4%); at 0.1, +14%, -1%,
#: +4%, -7%, -2%, +12%, +2%, -1% over eight bench runs of 5-8 saves and +0.9% pooled over 60 saves
#: of three A/Bs (single saves from -19% to +35%, as with nothing in flight: the machine's own noise;
#: the floor, another process writing, -5% to +5% in the same runs). The save stays in
#: flight 1.7-2.3 s for 300 MiB instead of 0.23-0.28 s (10 GB at this VM's 1.2 GB/s: ~80 s), well
#: below a usual save interval, and a blocking wait on it ends the rests at once.
BACKGROUND_DISK_SHARE: float = 0.1
DIRECT_IO_BLOCK_BYTES: int = 16 * 1024 * 1024
DIRECT_IO_QUEUE_DEPTH: int = 4

#: Verified reads that cannot copy and hash in one C pass (no extension, or a
#: reader that is not a local map) read and hash in slices of this many bytes,
#: each slice hashed while its bytes are hot in the cache (4 slices in flight
#: fit the 32 MiB L3 of the 2-core box; 256 KiB and 1 MiB slices cost more CPU
#: there in Python calls) (``Reader.read_into_hashed``, ``memcopy.copy_and_hash``).
HASH_SLICE_BYTES: int = 4 * 1024 * 1024

#: Whether checkpoint loads hash every checksum block whose bytes they return
#: and compare it with the saved record (``verify=None`` in
#: ``shardkit.checkpoint`` loads means this value). On by default, for every
#: load of shardkit's own format. A load that copies hashes each block while
#: its bytes are hot, in the same pass as the copy (``memcopy.copy_and_hash``:
#: one C loop with the extension's hasher, each 64-byte stripe loaded once for
#: both with AVX2). 1 GiB, warm cache, 2-core box, at least 11 interleaved
#: runs each: a load into fresh memory took 0.90-1.13x the unverified one's
#: time (median 1.05x over 20 runs), an in-place (``out=``) load, where no
#: page fault hides the hash, 1.03-1.12x (copy, then hash each 256 KiB
#: stride: 1.15-1.32x; each 4 MiB slice in a second call: 1.38x). A load that
#: maps (``MAP_LOADS``) hashes the whole blocks its maps lie in, from the
#: mapped pages, on the I/O threads, before it returns
#: (``storage.safetensors_format.tensor_io.map_verified``). From object stores, a block a rank
#: needs only part of is downloaded whole to be hashed while the load's
#: ``VERIFY_EXTRA_READ_FRACTION`` allowance lasts, else read unverified;
#: ``validate_distributed`` always re-hashes every byte.
VERIFY_ON_LOAD: bool = True

#: From object stores, the bytes a verified load may download beyond those it
#: wants, as a fraction of them, to verify blocks it reads only in part (0.1:
#: at most 1.1x the rank's bytes). 0: never download more than wanted.
VERIFY_EXTRA_READ_FRACTION: float = 0.1

#: Distributed loads (``load_distributed``, ``reshard``, ``load_consolidated``,
#: ``load_region``) that allocate their outputs return, for a tensor whose
#: whole output is one contiguous byte range of one local file, a tensor over
#: a private (copy-on-write) map of that range instead of a copy, unless
#: called with ``verify=True`` (private copies). Mapped tensors are verified
#: like copies (``VERIFY_ON_LOAD``). False: always copy.
MAP_LOADS: bool = True

#: ``load_distributed(out=...)`` reads a GPU or non-contiguous ``out`` tensor
#: through a temporary CPU tensor; temporaries of at most this many bytes are
#: alive at once (a larger tensor is staged alone), so loading a GPU state
#: does not hold a second copy of it in host memory.
LOAD_STAGE_BYTES: int = 256 * 1024 * 1024

#: The offline tools (``shardkit reshard`` / ``convert``) read the next tensor
#: (or new rank's slice) while the current one is written, in a second reused
#: buffer; one larger than this is not read ahead, so their peak memory stays
#: within the largest chunk moved + this + the write buffers.
OFFLINE_READ_AHEAD_MAX_BYTES: int = 160 * 1024 * 1024

# --- communication (shardkit.comm) -------------------------------------------

#: Largest flat buffer ``all_reduce_`` / ``broadcast_`` pack small tensors into;
#: one collective per bucket. Bigger buckets mean fewer calls but more copying
#: before the first byte moves.
COMM_BUCKET_BYTES: int = 32 * 1024 * 1024

#: How often a thread blocked in a collective re-checks its abort flag and
#: deadline when nothing wakes it earlier (abort wakes a helper-thread wait at
#: once). A Gloo wait runs inside the backend in slices that start at
#: ``COMM_ABORT_POLL_S`` and double up to ``COMM_ABORT_POLL_MAX_S``: each slice
#: that runs out costs the waiting process CPU (the backend raises, the wait is
#: re-entered). On the 2-core VM a rank waiting 2 s on a broadcast used 17.6 ms
#: of CPU with fixed 50 ms slices and 10.7 ms with doubling ones; with dozens of
#: ranks waiting on rank 0 that CPU is taken from rank 0. The work finishing
#: ends the wait at once whatever the slice.
COMM_ABORT_POLL_S: float = 0.05
COMM_ABORT_POLL_MAX_S: float = 0.4

#: Grace added to a group's timeout before shardkit gives up on a collective
#: itself, in case the backend's own timeout does not fire.
COMM_TIMEOUT_SLACK_S: float = 2.0

#: How an NCCL group's CUDA collectives wait; read when the group is built.
#: False (torch's way): a call returns once its work is queued, and later
#: work on the same CUDA stream sees the result; the host runs ahead of the
#: GPU. A collective that overruns the group's timeout (a dead peer) is then
#: caught by NCCL's watchdog, which ends the process (torch's default
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``; torchrun restarts it), and
#: ``AbortHandle.abort()`` aborts the communicator so the GPU is freed.
#: True: the calling thread also waits until the GPU has finished the
#: collective, so a dead peer raises ``CommTimeoutError`` (and ``abort()``
#: ``CommAbortedError``) in that thread, as on Gloo, and the communicator is
#: aborted so the GPU is freed; NCCL's watchdog is given
#: ``COMM_TIMEOUT_SLACK_S + NCCL_WATCHDOG_MARGIN_S`` more, to stay a backstop.
#: It costs the host's run-ahead: each call returns only when its GPU work is
#: done. The same trade as torch's ``TORCH_NCCL_BLOCKING_WAIT``.
COMM_NCCL_BLOCKING_WAIT: bool = False

#: Extra time NCCL's own watchdog gets, past the group's deadline, when
#: ``COMM_NCCL_BLOCKING_WAIT`` is on (so shardkit's error is raised first).
NCCL_WATCHDOG_MARGIN_S: float = 30.0

#: When True, every collective first exchanges a 8-byte digest of its
#: arguments (op, shapes, dtypes) so ranks that disagree get a clear
#: CommArgumentError at once instead of a backend error or a timeout. Costs
#: one extra small all_gather per call: meant for debugging and tests.
COMM_CHECK_ARGS: bool = False

#: Largest DCP ``.metadata`` file shardkit agrees to read (it grows with the
#: number of saved chunks: a large sharded model has tens of MiB).
DCP_MAX_METADATA_BYTES: int = 512 * 1024 * 1024

#: Most pickle opcodes a DCP ``.metadata`` may hold. DCP writes about one per
#: 2 bytes (a 23 MiB file of 160k chunks: 11.7M), so this admits ~200 MiB of
#: real metadata, while bounding what the unpickler builds from a hostile file
#: of one-byte opcodes (each can be a new object on its stack or in its memo).
DCP_MAX_METADATA_OPS: int = 100_000_000

#: Most ``.distcp`` files a DCP reader holds open at once; past it the least
#: recently used is closed (and reopened when next read: a metadata request on
#: an object store). A DCP saved with one file per tensor has thousands, and
#: holding them all ran out of file descriptors (EMFILE).
DCP_OPEN_FILES: int = 64

#: Check each DCP record's bytes against the CRC-32 its zip entry carries
#: (``torch.load`` does not): a flipped byte in a ``.distcp`` file raises
#: ``ChecksumError`` instead of loading. Costs a CRC pass over the bytes read
#: (ISA-L's, from the ``isal`` package: about 10 GiB/s on the 2-core benchmark VM).
DCP_VERIFY_CRC: bool = True

# --- object stores (shardkit.storage.backends.fsspec_store) ---------------------------

#: Part size of the multipart uploads shardkit makes to S3 (S3 wants 5 MiB to
#: 5 GiB per part, at most 10,000 parts); a file smaller than one part is a
#: single PUT. Also the size of the ranged GETs one large read is split into.
OBJECT_PART_BYTES: int = 16 * 1024 * 1024

#: Ranges fetched at once per large read (uploads: ``OBJECT_UPLOAD_PARTS_IN_FLIGHT``).
OBJECT_PARTS_IN_FLIGHT: int = 8

#: Parts uploaded at once per file (S3 multipart uploads). A loopback
#: SeaweedFS on 2 cores spent about 8% more CPU per byte taking 8 parts at
#: once than 4 (the server's CPU bounds a save there), and no faster.
#: Memory: the parts are sent from the tensors' own memory, not buffered.
OBJECT_UPLOAD_PARTS_IN_FLIGHT: int = 4

"""The ``s3`` suite: checkpoints on an S3 server, shardkit vs DCP's fsspec storage vs raw s3fs.

A SeaweedFS server (``shardkit.bench.seaweedfs``) runs on loopback for the
suite, with its data under the work directory; client and server share this
machine's cores, so the figures say how much client CPU each implementation
spends as much as how fast the wire is. One process, one rank.

- save: ``shardkit.checkpoint.save`` to ``s3://`` vs ``dcp.save`` with
  DCP's ``FsspecWriter`` (its defaults) vs raw s3fs puts of the same bytes
  (already one buffer, untimed): one ``put_object`` (one stream) and a
  multipart upload of ``RAW_PART_BYTES`` parts, ``RAW_PARTS_IN_FLIGHT`` at
  once. Each run writes to an empty prefix (the last run's objects deleted,
  untimed).
- load: ``shardkit.checkpoint.load`` vs ``dcp.load`` with ``FsspecReader``
  vs raw s3fs gets of one object holding the same bytes (one GET; ranged
  GETs of ``RAW_PART_BYTES``, ``RAW_PARTS_IN_FLIGHT`` at once), each copying
  into the destination tensors. Every implementation fills destination
  tensors allocated the same way (``torch.empty_like`` of the state, untimed,
  before each run); the first, untimed, load of each is checked equal to the state.

Implementations run interleaved, rep by rep (``common.time_interleaved``);
figures are the median, min and max. Not measured: several ranks, a remote
server, TLS.

Example::

    shardkit bench --only s3 --size 512MiB --reps 3
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from shardkit.bench.common import row, time_interleaved
from shardkit.bench.seaweedfs import make_bucket, pointed_at, seaweedfs_server
from shardkit.bench.workload import make_state, state_bytes
from shardkit.storage import byte_view

__all__ = ["run_s3_benchmarks", "DEFAULT_SIZE_BYTES"]

BUCKET = "shardkit-bench"
#: What the suite saves when the runner's ``--size`` is left at its default.
DEFAULT_SIZE_BYTES = 512 * 1024 * 1024
#: The raw parallel put/get: part size and parts in flight. On the 2-core box, 8 MiB x 4 was the
#: fastest ranged get of a sweep over 4-64 MiB x 2-8 (the server keeps objects in 4 MiB chunks); no put
#: setting stood out of the noise (the server's CPU bounds a put), so the put uses the same.
RAW_PART_BYTES = 8 * 1024 * 1024
RAW_PARTS_IN_FLIGHT = 4

SHARDKIT = "shardkit"
DCP = "dcp.save/load + FsspecWriter/Reader"
RAW_ONE = "s3fs, 1 stream (one PUT / one GET)"
RAW_PARALLEL = f"s3fs, {RAW_PART_BYTES >> 20} MiB parts, {RAW_PARTS_IN_FLIGHT} in flight"


@contextlib.contextmanager
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def _dcp_save(state: dict, url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    with _quiet_dcp():
        dcp.save(state, storage_writer=FsspecWriter(url))


def _dcp_load(dest: dict, url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    with _quiet_dcp():
        dcp.load(dest, storage_reader=FsspecReader(url))


def _blob(state: dict) -> bytes:
    """The state's tensor bytes, one after the other, as one buffer."""
    return b"".join(byte_view(t.contiguous()) for t in state.values())


def _fill(dest: dict, data, offset: int = 0) -> None:
    """Copy ``data`` (the blob's bytes from ``offset``) into the tensors of ``dest`` laid out as :func:`_blob`."""
    data = memoryview(data).cast("B")
    position = 0  # blob offset of the current tensor
    for t in dest.values():
        view = byte_view(t)
        lo, hi = max(position, offset), min(position + len(view), offset + len(data))
        if lo < hi:
            view[lo - position:hi - position] = data[lo - offset:hi - offset]
        position += len(view)


def _raw_get_parallel(fs, key: str, dest: dict, nbytes: int) -> None:
    """Ranged GETs of ``RAW_PART_BYTES``, ``RAW_PARTS_IN_FLIGHT`` at once (s3fs's async loop), each copied into ``dest``."""
    starts = list(range(0, nbytes, RAW_PART_BYTES))
    for first in range(0, len(starts), RAW_PARTS_IN_FLIGHT):
        batch = starts[first:first + RAW_PARTS_IN_FLIGHT]
        pieces = fs.cat_ranges([key] * len(batch), batch, [min(s + RAW_PART_BYTES, nbytes) for s in batch],
                               on_error="raise")
        for start, piece in zip(batch, pieces):
            _fill(dest, piece, start)


def bench_save(state: dict, fs, reps: int) -> list[dict]:
    """The save rows: each run to an empty prefix of its own (emptied, untimed, before each)."""
    import shardkit.checkpoint as ckpt

    nbytes, blob = state_bytes(state), _blob(state)
    urls = {name: f"s3://{BUCKET}/save/{i}" for i, name in enumerate((SHARDKIT, DCP, RAW_ONE, RAW_PARALLEL))}
    impls = {
        SHARDKIT: lambda: ckpt.save(state, urls[SHARDKIT]),
        DCP: lambda: _dcp_save(state, urls[DCP]),
        RAW_ONE: lambda: fs.pipe_file(urls[RAW_ONE] + "/blob", blob, chunksize=nbytes + 1),
        RAW_PARALLEL: lambda: fs.pipe_file(urls[RAW_PARALLEL] + "/blob", blob, chunksize=RAW_PART_BYTES,
                                           max_concurrency=RAW_PARTS_IN_FLIGHT),
    }

    def empty(name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(urls[name], recursive=True)

    timings = time_interleaved(impls, reps, empty)
    for name in impls:
        empty(name)
    return [row("s3 save, 1 rank", name, timing, kind="limit" if name.startswith("s3fs") else "peer",
                bytes=nbytes) for name, timing in timings.items()]


def bench_load(state: dict, fs, reps: int) -> list[dict]:
    """The load rows: each implementation reads its own objects, written once (untimed) before."""
    import shardkit.checkpoint as ckpt

    nbytes = state_bytes(state)
    sk_url, dcp_url, blob_key = (f"s3://{BUCKET}/load/{n}" for n in ("shardkit", "dcp", "raw/blob"))
    ckpt.save(state, sk_url)
    _dcp_save(state, dcp_url)
    fs.pipe_file(blob_key, _blob(state), chunksize=RAW_PART_BYTES, max_concurrency=RAW_PARTS_IN_FLIGHT)
    dest: dict[str, dict] = {}
    impls = {
        SHARDKIT: lambda: ckpt.load(dest[SHARDKIT], sk_url),
        DCP: lambda: _dcp_load(dest[DCP], dcp_url),
        RAW_ONE: lambda: _fill(dest[RAW_ONE], fs.cat_file(blob_key, max_concurrency=1)),
        RAW_PARALLEL: lambda: _raw_get_parallel(fs, blob_key, dest[RAW_PARALLEL], nbytes),
    }

    def allocate(name: str) -> None:
        dest.clear()  # the last run's destination is freed first: one at a time in memory
        dest[name] = {k: torch.empty_like(v) for k, v in state.items()}

    for name, load in impls.items():  # untimed: each works and yields the state
        allocate(name)
        load()
        wrong = [k for k, v in state.items() if not torch.equal(dest[name][k], v)]
        if wrong:
            raise AssertionError(f"{name} loaded different values for {wrong[:3]} ({len(wrong)} tensors)")
    timings = time_interleaved(impls, reps, allocate)
    dest.clear()
    fs.rm(f"s3://{BUCKET}/load", recursive=True)
    return [row("s3 load, 1 rank", name, timing, kind="limit" if name.startswith("s3fs") else "peer",
                bytes=nbytes) for name, timing in timings.items()]


def run_s3_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    """The ``s3`` suite of ``shardkit bench``: start SeaweedFS under ``workdir``, measure, stop it."""
    import s3fs

    state = make_state(size_bytes)
    root = os.path.join(workdir, "seaweedfs")
    os.makedirs(root, exist_ok=True)
    with seaweedfs_server(root) as server, pointed_at(server):
        make_bucket(BUCKET)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        return bench_save(state, fs, reps) + bench_load(state, fs, reps)


if __name__ == "__main__":
    import sys
    import tempfile

    from shardkit.bench.common import format_table
    from shardkit.sizes import size_bytes

    size = size_bytes(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SIZE_BYTES
    with tempfile.TemporaryDirectory(prefix="shardkit-s3-bench-") as work:
        print(format_table(run_s3_benchmarks(size, int(sys.argv[2]) if len(sys.argv) > 2 else 3, work)))

"""``shardkit bench --only metadata-scale``: metadata.json at 64..4096 ranks, simulated in one process.

No rank is spawned and no tensor byte written. For each rank count, an
FSDP2-style state of ``DEFAULT_TENSORS`` tensors (``Shard(0)`` over a 1-D
mesh; shapes from a small transformer-like table, several of whose first
dimensions do not divide evenly, some shorter than the mesh) is described as
every rank describes it (``compact_layout.Description``); each rank's report
(its file's record, header digest and data start) is made up to be exactly
what the plan says it wrote. Then, timed:

- ``commit_s``: rank 0's commit work: ``chunked_save.commit`` (plan every
  tensor's grid, check every rank's report, build the manifest, encode and
  write ``metadata.json``);
- ``json_bytes``: the size of that file;
- ``load_plan_s``: one loading rank's planning on another world size
  (three quarters of the ranks): read and parse ``metadata.json``
  (``read_manifest``) and plan the reads of its ``Shard(0)`` box of every
  tensor (``plan.plan_load``).

Each row is the median of ``reps`` runs; the growth exponent of a column is
the least-squares slope of log(value) on log(ranks) from 64 to 4096. The
tensor sizes only set the number of checksum blocks (O(bytes), not ranks).

Example::

    python -m shardkit.bench.checkpoint_suites.metadata_scale_bench 64,256,1024,4096 1000 3
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from torch.distributed.tensor import Shard

from shardkit.bench.checkpoint_suites.scale_bench import growth_exponent
from shardkit.checkpoint.saving.chunked_save import Prepared, commit
from shardkit.checkpoint.planning.compact_layout import Description, MeshInfo, TensorLayout
from shardkit.checkpoint.planning.dtensor_layout import placement_code
from shardkit.checkpoint.planning.grid_plan import grid_plan
from shardkit.checkpoint.format.grid_split import ChunkSplit
from shardkit.checkpoint.format.manifest import METADATA_FILE, read_manifest
from shardkit.checkpoint.planning.plan import plan_load
from shardkit.layout import Box
from shardkit.storage import FileRecord, storage_for

__all__ = ["run_metadata_scale_benchmarks", "simulate", "DEFAULT_RANKS", "DEFAULT_TENSORS"]

DEFAULT_RANKS = (64, 256, 1024, 4096)
DEFAULT_TENSORS = 1000
COLUMNS = ("commit_s", "json_bytes", "load_plan_s")
#: (name, shape, dtype) of one layer; the first dimensions 11008, 4097 and 1000 are uneven on most meshes,
#: 1000 and 8 shorter than the larger meshes (empty shards).
_LAYER = (("attn.qkv.weight", (12288, 4096), "BF16"), ("attn.out.weight", (4096, 4096), "BF16"),
          ("mlp.up.weight", (11008, 4096), "BF16"), ("mlp.down.weight", (4096, 11008), "BF16"),
          ("norm.weight", (4097,), "F32"), ("router.weight", (1000, 64), "F32"), ("gate.bias", (8,), "F32"))
_BLOCK_BYTES = 8 << 20


def _description(num_ranks: int, tensors: int) -> Description:
    placements = (Shard(0),)
    codes = tuple(tuple(placement_code(p)) for p in placements)
    out = {}
    for i in range(tensors):
        name, shape, dtype = _LAYER[i % len(_LAYER)]
        out[f"model.layers.{i // len(_LAYER)}.{name}"] = TensorLayout(shape, dtype, "mesh", 0, placements, codes)
    return Description(dict(sorted(out.items())), [MeshInfo((num_ranks,), tuple(range(num_ranks)))])


def _reports(desc: Description, num_ranks: int) -> list[dict]:
    """What every rank would report after writing its file (header length: a plausible 100 bytes per tensor)."""
    plan = grid_plan(desc, list(range(num_ranks)), num_ranks)
    per_rank_tensors = len(desc.tensors)
    reports = []
    for r in range(num_ranks):
        start = 8 + 100 * per_rank_tensors
        size = start + int(plan.data_bytes[r])
        blocks = [f"{(r * 7919 + b) & 0xFFFFFFFFFFFFFFFF:016x}" for b in range(-(-size // _BLOCK_BYTES))]
        record = FileRecord(size, f"xxh3_64_blocks:{r:016x}", _BLOCK_BYTES, blocks)
        reports.append({"record": record.to_json(), "header": f"{r:016x}", "data_start": start})
    return reports


def _load_plan(directory: str, num_ranks: int) -> float:
    """Seconds one rank of a world of ``3/4 * num_ranks`` takes to read metadata.json and plan its boxes."""
    new_world = max(1, num_ranks * 3 // 4)
    rank = new_world // 2
    begin = time.perf_counter()
    m = read_manifest(*storage_for(directory))
    want = {}
    for name, saved in m.tensors.items():
        shape = saved.spec.full_shape
        split = ChunkSplit(shape[0], (new_world,))
        want[name] = Box((split.offset(rank), *(0,) * (len(shape) - 1)), (split.size(rank), *shape[1:]))
    plan_load(m.tensors, want, lambda name: 1 << 20)
    return time.perf_counter() - begin


def simulate(num_ranks: int, tensors: int, workdir: str) -> dict:
    """One run at ``num_ranks``: ``{"ranks", "tensors", "commit_s", "json_bytes", "load_plan_s"}``."""
    desc = _description(num_ranks, tensors)
    written = _reports(desc, num_ranks)
    directory = os.path.join(workdir, f"metadata-scale-{num_ranks}")
    os.makedirs(directory, exist_ok=True)
    storage, path = storage_for(directory)
    prep = Prepared(0, num_ranks, lambda: grid_plan(desc, list(range(num_ranks)), num_ranks), {}, {}, None, {})
    begin = time.perf_counter()
    commit(storage, path, prep, written)
    commit_s = time.perf_counter() - begin
    json_bytes = os.path.getsize(os.path.join(directory, METADATA_FILE))
    return {"ranks": num_ranks, "tensors": tensors, "commit_s": commit_s, "json_bytes": json_bytes,
            "load_plan_s": _load_plan(directory, num_ranks)}


def _median_rows(ranks, tensors: int, reps: int, workdir: str) -> list[dict]:
    rows = []
    for n in ranks:
        runs = [simulate(n, tensors, workdir) for _ in range(reps)]
        row = {"ranks": n, "tensors": tensors, "json_bytes": runs[0]["json_bytes"]}
        for c in ("commit_s", "load_plan_s"):
            values = [r[c] for r in runs]
            row.update({c: statistics.median(values), f"{c}_min": min(values), f"{c}_max": max(values)})
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["ranks | tensors | commit_s (min..max) | json_bytes | bytes/(rank*tensor) | load_plan_s (min..max)",
             "--- | --- | --- | --- | --- | ---"]
    for r in rows:
        lines.append(f"{r['ranks']} | {r['tensors']} | {r['commit_s']:.3f} ({r['commit_s_min']:.3f}.."
                     f"{r['commit_s_max']:.3f}) | {r['json_bytes']:,} | {r['json_bytes'] / r['ranks'] / r['tensors']:.3f}"
                     f" | {r['load_plan_s']:.3f} ({r['load_plan_s_min']:.3f}..{r['load_plan_s_max']:.3f})")
    if len(rows) > 1:
        xs = [r["ranks"] for r in rows]
        lines.append("exponent | | " + " | ".join(f"{growth_exponent(xs, [r[c] for r in rows]):.2f}"
                                                     for c in ("commit_s", "json_bytes")) + " | | "
                     + f"{growth_exponent(xs, [r['load_plan_s'] for r in rows]):.2f}")
    return "\n".join(lines)


def run_metadata_scale_benchmarks(workdir: str, reps: int = 3, ranks=DEFAULT_RANKS,
                                  tensors: int = DEFAULT_TENSORS) -> list[dict]:
    """The rows for ``shardkit bench --only metadata-scale`` (medians of ``reps`` runs); prints the table."""
    rows = _median_rows(ranks, tensors, max(1, reps), workdir)
    print(f"metadata.json, simulated ({tensors} FSDP2 tensors, Shard(0)):\n{format_table(rows)}",
          file=sys.stderr, flush=True)
    return [{"suite": "metadata-scale", "case": f"metadata commit {r['ranks']}x{r['tensors']}", "impl": "shardkit",
             "median_s": r["commit_s"], "min_s": r["commit_s_min"], "max_s": r["commit_s_max"], **r}
            for r in rows]


def main(argv: list[str]) -> None:
    """``python -m shardkit.bench.checkpoint_suites.metadata_scale_bench [RANKS,...] [TENSORS] [REPS]``: one table."""
    import tempfile

    ranks = [int(n) for n in argv[0].split(",")] if argv else list(DEFAULT_RANKS)
    tensors = int(argv[1]) if len(argv) > 1 else DEFAULT_TENSORS
    reps = int(argv[2]) if len(argv) > 2 else 3
    with tempfile.TemporaryDirectory() as tmp:
        print(format_table(_median_rows(ranks, tensors, reps, tmp)))


if __name__ == "__main__":
    main(sys.argv[1:])

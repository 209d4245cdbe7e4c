"""``shardkit inspect DIR``: what a checkpoint holds, without reading its tensor data.

For a distributed checkpoint (``metadata.json``): format and version, the
saving world size, every tensor's dtype, full shape and how it is split, the
data files and their sizes, the plain values (--json: as metadata.json holds
them, NaN as {"float": "NaN"}, bytes as {"bytes": base64}) and user metadata. For a Hugging
Face checkpoint (``model.safetensors[.index.json]``, ``pytorch_model.bin[.index.json]``):
every tensor's dtype, shape and file (from the safetensors headers), the files
and the tied names. ``--json`` prints the same as JSON. Reads only manifests,
indexes and headers; never the tensor bytes (``shardkit validate`` checks
those). Exit code 1 for a distributed checkpoint with a file missing, of the
wrong size or with a bad header (listed under the summary), 2 when DIR is
missing or not a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math

from shardkit.cli.json_out import json_text
from shardkit.cli.target import DCP, HF, checkpoint_kind


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint holds (reads only its manifest or headers)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a checkpoint directory or URL: distributed (metadata.json), "
                                "Hugging Face or PyTorch DCP (.metadata)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def _row(name: str, saved) -> dict:
    from shardkit.checkpoint.format.compact_manifest import GridChunks
    from shardkit.dtypes import NAME_TO_DTYPE

    spec = saved.spec
    split = "replicated" if spec.shard_dim is None else f"dim {spec.shard_dim}: {list(spec.shard_sizes)}"
    if saved.chunks is not None:
        split = f"{len(saved.chunks)} chunk(s)" + (", a grid" if isinstance(saved.chunks, GridChunks) else "")
    itemsize = NAME_TO_DTYPE[saved.dtype].itemsize if saved.dtype in NAME_TO_DTYPE else None
    nbytes = math.prod(spec.full_shape) * itemsize if itemsize is not None else None
    owner = saved.owner_rank
    return {"name": name, "dtype": saved.dtype or "(in header)", "shape": list(spec.full_shape),
            "split": split + (f", owner rank {owner}" if owner is not None else ""), "bytes": nbytes}


def run(args) -> int:
    kind = checkpoint_kind(args.path)
    if kind == DCP:
        return _run_dcp(args)
    if kind == HF:
        from shardkit.cli.inspect_hf import hf_summary, print_hf_summary

        summary = hf_summary(args.path)
        if args.json:
            print(json_text(summary))
        else:
            print_hf_summary(summary)
        return 0
    return _run_distributed(args)


def _run_dcp(args) -> int:
    from shardkit.sources import open_source

    with open_source(args.path, "dcp") as source:
        tensors, values = source.tensors(), source.objects()
    rows = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "bytes": t.nbytes}
            for n, t in sorted(tensors.items())]
    if args.json:
        print(json_text({"path": args.path, "kind": "dcp", "tensors": rows, "objects": values}, default=repr))
        return 0
    print(f"{args.path}: PyTorch DCP checkpoint (.metadata read by a restricted unpickler)")
    print(f"{len(rows)} tensor(s), {sum(r['bytes'] for r in rows):,} bytes in all")
    width = max((len(r["name"]) for r in rows), default=4)
    for r in rows:
        print(f"  {r['name']:<{width}}  {r['dtype']:<9} {r['shape']}")
    if values:
        print("values:")
        for line in summarise_values({n: v if isinstance(v, (int, float, str, bool, type(None), bytes)) else repr(v)
                                      for n, v in values.items()}):
            print(f"  {line}")
    return 0


def _run_distributed(args) -> int:
    from shardkit.checkpoint import read_metadata, validate_distributed
    from shardkit.hf.untrusted import hostile_input
    from shardkit.storage.plain_values import encode_objects

    with hostile_input(args.path, fix="the checkpoint is damaged; restore it or use an earlier one"):
        m = read_metadata(args.path)
    # metadata, files, sizes and headers; not the tensor bytes (validate reads those)
    problems = validate_distributed(args.path, hash_bytes=False).problems
    rows = [_row(name, saved) for name, saved in sorted(m.tensors.items())]
    summary = {
        "path": args.path,
        "format_version": m.format_version,
        "num_ranks": m.num_ranks,
        "tensors": rows,
        "files": {name: rec.bytes for name, rec in sorted(m.files.items())},
        "objects": encode_objects(m.objects),  # metadata.json's typed form: strict JSON, never ambiguous
        "user_metadata": m.user_metadata,
        "bases": [b.dir for b in m.bases],   # version 3: the sibling checkpoints chunks are read from
        "problems": problems,
    }
    if args.json:
        print(json_text(summary))
        return 1 if problems else 0
    version = "seed format (ferrotorch 0.4)" if m.format_version is None else f"format v{m.format_version}"
    total = sum(r["bytes"] or 0 for r in rows)
    print(f"{args.path}: distributed checkpoint, {version}, saved by {m.num_ranks} rank(s)")
    print(f"{len(rows)} tensor(s), {total:,} bytes in all")
    width = max((len(r["name"]) for r in rows), default=4)
    for r in rows:
        print(f"  {r['name']:<{width}}  {r['dtype']:<6} {str(r['shape']):<18} {r['split']}")
    if m.bases:
        print(f"incremental: reads unchanged chunks from {', '.join(b.dir for b in m.bases)} (beside it)")
    if m.files:
        print("files (as recorded in metadata.json):")
        for name, size in summary["files"].items():
            print(f"  {name:<24} {size:>14,} bytes")
    for title, values in (("values", m.objects), ("user metadata", m.user_metadata)):
        if values:
            print(f"{title}:")
            for line in summarise_values(values):
                print(f"  {line}")
    if problems:
        print(f"NOT COMPLETE: {len(problems)} problem(s) (shardkit validate checks the bytes too):")
        for problem in problems[:MAX_VALUES_SHOWN]:
            print(f"  {problem}")
        return 1
    return 0


#: Plain values shown by ``inspect`` before the rest is summarised (``--json`` prints all).
MAX_VALUES_SHOWN = 12
MAX_VALUE_CHARS = 60


def summarise_values(values: dict) -> list[str]:
    """One short line per plain value, at most ``MAX_VALUES_SHOWN``, then how many more there are.

    A string is shown quoted (``'nan'``), a JSON value as JSON (``NaN``,
    ``Infinity`` for those floats), anything else by its repr
    (``np.float32(1.5)``, ``b'...'`` with its length when cut).

    >>> summarise_values({"step": 5, "lr": 0.001, "note": "x" * 100})[:2]
    ['step = 5', 'lr = 0.001']
    """
    lines = []
    for name, value in list(values.items())[:MAX_VALUES_SHOWN]:
        text = _value_text(value)
        lines.append(f"{name} = {text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + '...'}")
    if len(values) > MAX_VALUES_SHOWN:
        lines.append(f"... and {len(values) - MAX_VALUES_SHOWN} more (--json shows every value)")
    return lines


def _value_text(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        text = repr(value)
        return text if len(text) <= MAX_VALUE_CHARS else f"{text[:MAX_VALUE_CHARS - 24]}... ({len(value):,} bytes)"
    if type(value).__module__ == "numpy":  # np.float32(1.5): the type is part of the value (np.float64 too)
        return repr(value)
    return json.dumps(value, ensure_ascii=False)

"""``shardkit convert SRC DST --to hf|distributed``: export a model as Hugging Face, or import any checkpoint.

SRC may be a shardkit distributed checkpoint, a Hugging Face directory or a
PyTorch DCP checkpoint (``--from``, detected when left out). DCP's pickled
``.metadata`` is read through a restricted unpickler: one that carries code
is refused and never runs. ``--to hf`` exports the model tensors only, by
default: no optimizer state, scheduler, step or per-rank ``__rank_state__``,
and a lone ``model.`` subtree stripped (a Hugging Face model's ``model.*``
beside ``lm_head.weight`` stays as named); ``--prefix P`` exports the
subtree P instead (stripped), ``--prefix ''`` every tensor as named,
optimizer state included. Optionally cast with ``--dtype``, in shards of at
most ``--max-shard-size``, plus ``config.json`` (``--config``, or one found
in SRC); written by the same writer as ``shardkit.hf.save_checkpoint``.
``--to distributed`` (or ``--to shardkit``: the same format, shardkit's own
per-rank one, not DCP's "Distributed Checkpoint") writes a one-rank checkpoint
with every tensor replicated (loads on any world size).
Tensor by tensor; DST appears complete or not at all.
Exit codes: 0 done, 1 SRC is incomplete or corrupt, 2 bad input (a missing SRC, DST exists, a bad option,
a --from naming a format SRC does not hold).

Example: shardkit convert dcp_ckpt hf_out --to hf --prefix model. --dtype bf16
"""

from __future__ import annotations

import argparse

from shardkit.cli._tools import add_common, progress_bar
from shardkit.cli.json_out import json_text
from shardkit.cli.target import check_from, checkpoint_kind
from shardkit.errors import InputError

#: Clearer names the options take for a kind (the kind keeps its name on disk and in output).
KIND_ALIASES = {"shardkit": "distributed"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32",
          "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert between distributed, Hugging Face and DCP checkpoints",
                       description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="the checkpoint to read (distributed, HF or DCP directory)")
    p.add_argument("dst", help="the directory to write (must not exist)")
    p.add_argument("--to", required=True, choices=("hf", "distributed", "shardkit"),
                   help="the format to write (shardkit: another name for distributed, shardkit's own format)")
    p.add_argument("--from", dest="from_kind", choices=("distributed", "shardkit", "hf", "dcp"), default=None,
                   help="the format of SRC (default: detected; shardkit is another name for distributed)")
    p.add_argument("--max-shard-size", default="5GB", help="largest HF shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="cast floating tensors to this dtype")
    p.add_argument("--prefix", default=None,
                   help="export only the subtree under this prefix, stripped (--to hf; default: the model "
                        "tensors, without optimizer state or __rank_state__; '' for every tensor)")
    p.add_argument("--config", default=None, help="a config.json to write beside the weights (--to hf)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_common(p)
    p.set_defaults(run=run)


def run(args) -> int:
    import os
    import time

    import torch

    from shardkit.offline import export_distributed, export_hf
    from shardkit.sources import detect_kind, open_source

    args.to = KIND_ALIASES.get(args.to, args.to)
    args.from_kind = KIND_ALIASES.get(args.from_kind, args.from_kind)
    max_shard_bytes = _max_shard_bytes(args.max_shard_size)  # options first: a bad one is 2, nothing opened
    if args.config and not os.path.isfile(args.config):
        raise FileNotFoundError(f"--config {args.config} does not exist")
    # a missing path or not a checkpoint is bad input (2), not a bad checkpoint
    local_kind = checkpoint_kind(args.src) if "://" not in args.src else None
    if args.from_kind and local_kind and args.from_kind != local_kind:
        check_from(args.src, args.from_kind, local_kind)
    kind = args.from_kind or local_kind or detect_kind(args.src)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    with open_source(args.src, kind) as src:
        total = sum(i.nbytes for i in src.tensors().values())
    start = time.perf_counter()
    with progress_bar(args, total, f"convert {kind} -> {args.to}") as update:
        if args.to == "hf":
            export_hf(args.src, args.dst, kind=kind, prefix=args.prefix, dtype=dtype,
                      max_shard_bytes=max_shard_bytes, config=args.config, progress=update)
        else:
            export_distributed(args.src, args.dst, kind=kind, dtype=dtype, progress=update)
    seconds = time.perf_counter() - start
    with open_source(args.dst) as out:
        count = len(out.tensors())
    summary = {"src": args.src, "from": kind, "dst": args.dst, "to": args.to, "tensors": count,
               "seconds": round(seconds, 3)}
    if args.json:
        print(json_text(summary))
    else:
        print(f"{args.dst}: {count} tensors written as {args.to} from {kind} checkpoint {args.src} in {seconds:.2f} s")
    return 0


def _max_shard_bytes(value: str) -> int:
    """``--max-shard-size`` in bytes (``shard_size_bytes``' rules); ``InputError`` (exit 2) when it is not a
    positive whole size."""
    from shardkit.errors import MetadataError
    from shardkit.hf.index import shard_size_bytes

    try:
        nbytes = shard_size_bytes(value)
    except MetadataError as e:
        raise InputError(f"--max-shard-size {value!r} is not a size: {e}") from e
    if nbytes < 1:
        raise InputError(f"--max-shard-size {value!r} is {nbytes} bytes; give a positive size such as 5GB or 500MB")
    return nbytes

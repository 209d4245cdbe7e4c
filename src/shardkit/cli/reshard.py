"""``shardkit reshard SRC DST --world-size M``: rewrite a distributed checkpoint for M ranks, offline.

Reads each new rank's slice of every tensor (only the bytes that overlap it,
every checksum block verified) while the previous slice is written, in two
reused buffers: memory stays around two of the largest chunks moved, not the
checkpoint. DST is built in a temporary sibling directory, checked (metadata,
sizes, headers; its checksums are those of the bytes written), then renamed
into place, so it is complete or absent (a kill midway leaves no DST).
Exit codes: 0 done, 1 SRC is incomplete or corrupt, 2 bad input (a missing SRC, DST exists, a bad option).

Example: shardkit reshard ckpt/step-100 ckpt/step-100-ws3 --world-size 3
"""

from __future__ import annotations

from shardkit.cli._tools import add_common, progress_bar
from shardkit.cli.json_out import json_text
from shardkit.cli.target import DISTRIBUTED, checkpoint_kind
from shardkit.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("reshard", help="rewrite a distributed checkpoint for another world size (offline)",
                       description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("src", help="a shardkit distributed checkpoint directory (with metadata.json)")
    p.add_argument("dst", help="the new checkpoint directory (must not exist)")
    p.add_argument("--world-size", type=int, required=True, metavar="M", help="the number of ranks to reshard for")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_common(p)
    p.set_defaults(run=run)


def run(args) -> int:
    import time

    from shardkit.checkpoint import read_metadata
    from shardkit.offline import reshard_checkpoint
    from shardkit.sources import open_source

    if args.world_size < 1:
        raise InputError(f"--world-size must be >= 1, got {args.world_size}; pass the number of ranks to reshard for")
    kind = checkpoint_kind(args.src)  # a missing path or not a checkpoint: bad input (2), not a bad checkpoint
    if kind != DISTRIBUTED:
        raise InputError(f"{args.src} is a {kind} checkpoint; reshard rewrites shardkit distributed checkpoints: "
                         f"import it first with `shardkit convert {args.src} DIR --to distributed`")
    m = read_metadata(args.src)
    with open_source(args.src, "distributed") as src:
        total = sum(i.nbytes for i in src.tensors().values())
    start = time.perf_counter()
    with progress_bar(args, total, "reshard") as update:
        reshard_checkpoint(args.src, args.dst, args.world_size, progress=update)
    seconds = time.perf_counter() - start
    summary = {"src": args.src, "dst": args.dst, "from_ranks": m.num_ranks, "to_ranks": args.world_size,
               "tensors": len(m.tensors), "bytes": total, "seconds": round(seconds, 3)}
    if args.json:
        print(json_text(summary))
    else:
        print(f"{args.dst}: {len(m.tensors)} tensors ({total:,} bytes) resharded {m.num_ranks} -> "
              f"{args.world_size} ranks in {seconds:.2f} s; checked")
    return 0

"""``shardkit diff A B``: what differs between two checkpoints (distributed, Hugging Face or DCP, mixed freely).

Lists tensors only in A or only in B, shape and dtype changes, plain values
that differ, and for every common tensor whether it is identical: from the
recorded checksums without reading where both carry comparable ones (two
shardkit distributed checkpoints; --verify reads and checks the bytes
instead, as validate does), else by reading both, one tensor at a time,
with the largest absolute and relative (max|a-b| / max|a|) difference.
Exit codes: 0 identical, 1 they differ, 2 bad input or a damaged checkpoint (as diff(1): trouble).

Example: shardkit diff ckpt/step-100 ckpt/step-200 --json
"""

from __future__ import annotations

import argparse
import json

from shardkit.cli._tools import add_common, progress_bar
from shardkit.cli.json_out import json_text


def register(sub) -> None:
    p = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 when they differ)",
                       description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="a checkpoint directory (distributed, HF or DCP)")
    p.add_argument("b", help="another checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--all", action="store_true", help="also list identical tensors")
    p.add_argument("--verify", action="store_true",
                   help="read and check every common tensor's bytes, even where the recorded checksums match")
    add_common(p)
    p.set_defaults(run=run, damaged_exit=2)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _value_text(value) -> str:
    """A value as JSON where it is plain, else its repr (bytes, a set, a dtype, a tensor); one line, <= 80 chars."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return " ".join(text.split())[:80]


def run(args) -> int:
    from shardkit.offline import diff_checkpoints
    from shardkit.sources import open_source

    with open_source(args.a) as a:
        total = sum(i.nbytes for i in a.tensors().values())
    with progress_bar(args, total, "diff") as update:
        report = diff_checkpoints(args.a, args.b, progress=update, verify=args.verify)
    if args.json:
        print(json_text(report.to_json(), default=str))
        return 0 if report.identical else 1
    same = [t for t in report.tensors if t.status == "identical"]
    print(f"A: {args.a}\nB: {args.b}")
    for name in report.only_a:
        print(f"  - {name}  (only in A)")
    for name in report.only_b:
        print(f"  + {name}  (only in B)")
    for t in report.tensors:
        if t.status == "shape":
            print(f"  ~ {t.name}  shape {t.how}")
        elif t.status == "dtype":
            print(f"  ~ {t.name}  dtype {t.how}  (max abs diff {_fmt(t.max_abs)}, max rel {_fmt(t.max_rel)})")
        elif t.status == "different":
            print(f"  ~ {t.name}  values differ: max abs diff {_fmt(t.max_abs)}, max rel {_fmt(t.max_rel)}")
        elif args.all:
            print(f"  = {t.name}  identical ({'recorded checksums' if t.how == 'checksum' else t.how})")
    for name, (va, vb) in report.values.items():
        print(f"  ~ {name}  value {_value_text(va)} -> {_value_text(vb)}")
    by_checksum = sum(1 for t in same if t.how == "checksum")
    verdict = "identical" if report.identical else "differ"
    how = (f"{by_checksum} from recorded checksums, bytes not read: --verify reads them" if by_checksum
           else "all by reading")
    print(f"{verdict}: {len(same)} of {len(report.tensors)} common tensors identical ({how}), "
          f"{len(report.only_a)} only in A, {len(report.only_b)} only in B")
    return 0 if report.identical else 1

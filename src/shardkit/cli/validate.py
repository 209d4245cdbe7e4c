"""``shardkit validate DIR``: is this checkpoint complete and intact?

Re-reads every data file and compares sizes and checksums with the manifest.
Prints each problem on its own line; exit code 0 when the checkpoint is
complete and intact, 1 otherwise. It never modifies the checkpoint.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("validate", help="check that a checkpoint is complete and its bytes match their checksums",
                       description=__doc__)
    p.add_argument("path", help="a distributed checkpoint directory (with metadata.json)")
    p.set_defaults(run=run)


def run(args) -> int:
    from shardkit.checkpoint import validate_distributed

    report = validate_distributed(args.path)
    if report.ok:
        print(f"{args.path}: ok")
        return 0
    print(f"{args.path}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1

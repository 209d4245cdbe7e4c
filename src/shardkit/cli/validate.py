"""``shardkit validate DIR``: is this checkpoint complete and intact?

A distributed checkpoint (``metadata.json``): re-reads every data file and
compares sizes and checksums with the manifest. A Hugging Face checkpoint
(``model.safetensors[.index.json]``, ``pytorch_model.bin[.index.json]``):
every file the index names is there, its header reads back, and its tensors
fit the file. A PyTorch DCP checkpoint (``.metadata``): every tensor and
value record is read back through the restricted reader and checked against
the CRC-32s it carries. Prints the first problems (all with ``--all``; ``--json`` for
``{"path", "ok", "problems"}``). Exit code 0 when complete and intact, 1 when
not, 2 when DIR is missing or not a checkpoint. It never modifies the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib

from shardkit.cli._tools import add_common, progress_bar, setup_logging
from shardkit.cli.json_out import json_text
from shardkit.cli.target import DCP, DISTRIBUTED, checkpoint_kind

#: Problems printed before "... and N more" without --all.
SHOWN_PROBLEMS = 20


def register(sub) -> None:
    p = sub.add_parser("validate", help="check that a checkpoint is complete and its bytes match their checksums",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a checkpoint directory: distributed (metadata.json), Hugging Face, or PyTorch DCP "
                               "(.metadata; it has no checksums, so every tensor is read once)")
    p.add_argument("--all", action="store_true", help=f"print every problem, not just the first {SHOWN_PROBLEMS}")
    p.add_argument("--json", action="store_true", help='print {"path", "ok", "problems": [...]} as JSON')
    add_common(p)
    p.set_defaults(run=run)


def problems_of(path: str, progress=None) -> list[str]:
    """Every problem of the checkpoint at ``path`` (``[]``: complete and intact); ``progress`` as
    :func:`~shardkit.checkpoint.validate_distributed` takes it (distributed checkpoints only)."""
    kind = checkpoint_kind(path)
    if kind == DCP:
        return dcp_problems(path)
    if kind == DISTRIBUTED:
        from shardkit.checkpoint import validate_distributed
        from shardkit.hf.untrusted import hostile_input

        with hostile_input(path, fix="the checkpoint is damaged; restore it or use an earlier one"):
            return list(validate_distributed(path, progress=progress).problems)
    from shardkit.hf import checkpoint_problems

    return checkpoint_problems(path)


def dcp_problems(path: str) -> list[str]:
    """What is wrong with a DCP checkpoint: every tensor record and every value record is read once
    (one at a time) through the restricted reader, each checked against the CRC-32s its record
    carries; each failure is one problem."""
    from shardkit.errors import ShardkitError
    from shardkit.sources import DcpCheckpoint

    try:
        ck = DcpCheckpoint(path)
    except (ShardkitError, OSError) as e:
        return [f"{path}: {e}"]
    problems = []
    with ck:
        reads = [(n, ck.read) for n in ck.tensors] + [(n, ck.read_value) for n in ck.values]
        for name, read in reads:
            try:
                read(name)
            except (ShardkitError, OSError) as e:
                problems.append(f"{name}: {e}")
    return problems


def run(args) -> int:
    setup_logging(args)
    with contextlib.ExitStack() as stack:
        problems = problems_of(args.path, _lazy_bar(args, stack))
    return _report(args, problems)


def _lazy_bar(args, stack: contextlib.ExitStack):
    """A ``progress(advance_bytes, total_bytes)`` that opens the bar once the total is known."""
    update = None

    def progress(advance_bytes: int, total_bytes: int) -> None:
        nonlocal update
        if update is None:
            update = stack.enter_context(progress_bar(args, total_bytes, "validating")) or (lambda n: None)
        update(advance_bytes)

    return progress


def _report(args, problems: list[str]) -> int:
    if args.json:
        print(json_text({"path": args.path, "ok": not problems, "problems": problems}))
        return 0 if not problems else 1
    if not problems:
        print(f"{args.path}: ok")
        return 0
    print(f"{args.path}: {len(problems)} problem(s)")
    shown = problems if args.all else problems[:SHOWN_PROBLEMS]
    for problem in shown:
        print(f"  - {' '.join(problem.split())}")
    if len(shown) < len(problems):
        print(f"  ... and {len(problems) - len(shown)} more (use --all or --json)")
    return 1

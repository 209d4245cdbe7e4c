"""``shardkit demo``: a tiny Llama trains with FSDP2 on 4 CPU ranks, checkpointing in the background;
a rank is killed in the middle of a save; 2 ranks resume from the latest complete checkpoint with the same
losses bit for bit; the model is exported to Hugging Face and reloaded with from_pretrained. About 30-60 s.
Needs transformers (pip install 'shardkit[hf]'); nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os

from shardkit.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("demo", description=__doc__,
                       help="train on 4 ranks, kill one mid-save, resume on 2 with the same losses, export to HF")
    p.add_argument("path", nargs="?", default=None,
                   help="a new or empty directory to keep the checkpoints and the HF export in (default: a temp dir)")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.path is not None:
        _check_target(args.path)
    if importlib.util.find_spec("transformers") is None:
        raise InputError("the demo needs transformers (it trains a transformers Llama): pip install 'shardkit[hf]'")
    from shardkit.demo import run_demo  # imports torch: after the cheap checks

    return run_demo(args.path)


def _check_target(path: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"{path} exists and is not a directory; pass a new or empty directory")
    if os.path.isdir(path) and os.listdir(path):
        raise InputError(f"{path} is not empty; pass a new or empty directory (the demo writes its checkpoints there)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise InputError(f"{parent} does not exist; create it first, or pass another path")

"""Evaluation metrics stored beside a checkpoint (``eval_metrics.json``).

Written atomically, read back with a size limit; a checkpoint without
metrics is normal (``None``). This module does not pick a best checkpoint.

Example::

    save_checkpoint_metrics(path, {"eval_loss": 1.93})
    load_checkpoint_metrics(path)        # {"eval_loss": 1.93}
"""

from __future__ import annotations

import json
import math
from typing import Dict, Optional

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.hf.untrusted import check_limits, hostile_input, read_json_file
from shardkit.storage import storage_for

__all__ = ["METRICS_FILE_NAME", "save_checkpoint_metrics", "load_checkpoint_metrics"]

METRICS_FILE_NAME = "eval_metrics.json"


def save_checkpoint_metrics(checkpoint_path: str, metrics: Dict[str, float]) -> None:
    """Write ``metrics`` (name -> number) to ``checkpoint_path/eval_metrics.json``, atomically.

    Creates ``checkpoint_path`` if it is not there yet (as forgather does), so
    metrics may be written before or after the checkpoint's weights. A value
    that is not a finite number (a tensor, a bool, NaN, an infinity: JSON has
    no NaN/Infinity and :func:`load_checkpoint_metrics` would refuse the
    file) raises ``MetadataError`` naming the key, before anything is written.
    """
    bad = {k: v for k, v in metrics.items() if not isinstance(k, str) or not _is_number(v)}
    if bad:
        raise MetadataError(
            f"metrics must map names to finite numbers; these do not: {dict(list(bad.items())[:5])}. "
            f"Convert tensors with .item(); leave out a NaN or infinite value (e.g. a diverged eval_loss), "
            f"or record it as a large finite number. Nothing was written."
        )
    store, root = storage_for(checkpoint_path)
    store.makedirs(root)
    data = json.dumps({k: float(v) for k, v in metrics.items()}, indent=2, allow_nan=False).encode()
    with store.atomic_writer(store.join(root, METRICS_FILE_NAME)) as f:
        f.write(data)


def _is_number(v) -> bool:
    """A finite int or float (not a bool): what ``eval_metrics.json`` holds and reads back."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int too large for a float
        return False


def load_checkpoint_metrics(checkpoint_path: str) -> Optional[Dict[str, float]]:
    """The metrics saved with ``checkpoint_path``, or None if there are none.

    A file that is not a regular file, not a JSON object of name -> number
    (NaN, infinities and booleans are not numbers here), or over the limits
    (``knobs.MAX_INDEX_BYTES``, ``knobs.MAX_METRICS``) raises ``MetadataError``.
    """
    store, root = storage_for(checkpoint_path)
    path = store.join(root, METRICS_FILE_NAME)
    if not store.exists(path):
        return None
    fix = "it should map metric names to numbers; delete it or save the metrics again"
    metrics = read_json_file(store, path, fix=fix)
    check_limits(path, "metrics", metrics, max_count=knobs.MAX_METRICS)
    with hostile_input(path, fix=fix):
        bad = [k for k, v in metrics.items() if not _is_number(v)]
    if bad:
        raise MetadataError(
            f"{path}: metric {bad[0][:80]!r} is {str(metrics[bad[0]])[:80]!r} "
            f"({type(metrics[bad[0]]).__name__}), not a number ({len(bad)} such); {fix}"
        )
    return metrics

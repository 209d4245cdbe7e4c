"""The metrics a ``CheckpointManager`` keeps with each step, and its ``best=`` argument, checked.

Metrics are numbers; a one-element tensor or numpy value is read with
``.item()``; NaN and the infinities are kept under their
``json_io.NON_FINITE`` names (JSON has none). Anything else is a
``MetadataError`` naming the key, raised before anything is written. Nothing
here reads or writes a file.

Example::

    encode_metrics({"loss": torch.tensor(0.5), "ppl": float("inf")})   # {'loss': 0.5, 'ppl': 'Infinity'}
    parse_best("loss")                                                  # ('loss', 'min')
"""

from __future__ import annotations

import math

from shardkit.errors import MetadataError
from shardkit.storage.json_io import non_finite_name

__all__ = ["encode_metrics", "parse_best", "best_step"]


def encode_metrics(metrics) -> dict:
    """``metrics`` as JSON numbers (a non-finite one by its ``json_io.NON_FINITE`` name); ``MetadataError``
    naming the key for anything else. Runs before anything is waited for or written."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise MetadataError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    return {_metric_name(key): _metric_value(key, value) for key, value in metrics.items()}


def _metric_name(key) -> str:
    if not isinstance(key, str):
        raise MetadataError(f"metric names must be strings, got {key!r}")
    return key


def _metric_value(key: str, value):
    number = _as_number(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise MetadataError(f"metric {key!r} is {type(value).__name__} {str(value)[:80]}; metrics are numbers "
                            f"(pass float(...) of it)")
    if isinstance(number, int) or math.isfinite(number):
        return number
    return non_finite_name(number)  # JSON has no NaN; metrics() gives the float back


def _as_number(value):
    """``value``, or its ``.item()`` when it is a one-element tensor or numpy value."""
    if isinstance(value, (int, float)):
        return value
    try:
        return value.item()
    except (AttributeError, ValueError, RuntimeError):  # not an array, or more than one element
        return value


def parse_best(best):
    if best is None:
        return None
    if isinstance(best, str):
        return best, "min"
    if isinstance(best, (tuple, list)) and len(best) == 2 and best[1] in ("min", "max"):
        return str(best[0]), best[1]
    raise MetadataError(f"best must be None, a metric name or (name, 'min' | 'max'), got {best!r}")


def best_step(steps, metrics_of, best, *, skip=()) -> int | None:
    """The step of ``steps`` whose metric is best by ``best`` (``(name, "min" | "max")``, or None: no
    best step); ties go to the newest. ``metrics_of(step)`` gives a step's metrics; a step for which it
    raises one of ``skip`` (removed since it was listed) is passed over, a step without a finite number
    under ``name`` too. Example: ``best_step([3, 5], mgr.metrics, ("loss", "min"))``."""
    if best is None:
        return None
    name, mode = best
    scored = []
    for step in steps:
        try:
            value = metrics_of(step).get(name)
        except skip:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            scored.append((value if mode == "min" else -value, -step, step))
    return min(scored)[2] if scored else None

"""What ``--json`` prints: standard JSON, whatever floats a checkpoint holds.

``json.dumps`` writes a NaN or infinite float as the bare word ``NaN`` or
``Infinity``, which is not JSON: ``jq``, JavaScript and strict parsers refuse
the whole document. A checkpoint's plain values (a loss of ``nan``) and a
diff's figures (the difference of two infinite tensors) can be such floats,
so they are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` instead; every other value is written as ``json.dumps`` would.

Example::

    json_text({"loss": float("nan")})   # '{"loss": "NaN"}'
"""

from __future__ import annotations

import json
import math
from typing import Any

from shardkit.storage.json_io import non_finite_name

__all__ = ["json_text"]


def json_text(obj: Any, *, indent: int | None = 2, default=None) -> str:
    """``obj`` as standard JSON text (non-finite floats as strings; non-ASCII kept as is)."""
    return json.dumps(_finite(obj), indent=indent, ensure_ascii=False, allow_nan=False,
                      default=(lambda o: _finite(default(o))) if default else None)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return non_finite_name(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj

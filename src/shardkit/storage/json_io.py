"""Untrusted JSON from disk: parse it, or raise a ``MetadataError`` that says how to fix it.

Every JSON file shardkit reads (``metadata.json``, rank manifests, shard
indexes, metrics, safetensors headers) must be an object. This module parses
bytes only; callers read the file (with their size limit) and check the shape.

Example::

    obj = parse_json_object("ckpt/metadata.json", raw, fix="the file is corrupt or was cut short")
"""

from __future__ import annotations

import json

from shardkit.errors import MetadataError

__all__ = ["parse_json_object"]


def parse_json_object(source: str, data: bytes, *, fix: str) -> dict:
    """The JSON object in ``data``; ``MetadataError`` naming ``source`` and ``fix`` otherwise."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MetadataError(f"{source} is not valid JSON ({e}); {fix}") from e
    if not isinstance(obj, dict):
        raise MetadataError(f"{source} holds a JSON {type(obj).__name__}, expected an object; {fix}")
    return obj

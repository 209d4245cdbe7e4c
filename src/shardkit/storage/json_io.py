"""Untrusted JSON from disk: parse it once, with limits, or raise a ``MetadataError`` that says how to fix it.

Every JSON file shardkit reads (``metadata.json``, rank manifests, shard
indexes, metrics, safetensors headers) must be an object. This module parses
bytes only; callers read the file (with their size limit) and check the shape
with the ``expect_*`` helpers, which raise :class:`MetadataError` naming what
was found. Limits (``shardkit.knobs``):

- nesting deeper than ``MAX_JSON_DEPTH`` is refused by a linear scan *before*
  parsing, so no input reaches Python's recursion limit;
- number literals longer than ``MAX_JSON_NUMBER_CHARS`` (a 5,000-digit
  integer), ``NaN``, ``Infinity`` and floats that overflow (``1e400``) are
  refused while parsing.

Cost: linear in the text, and close to ``json.loads`` itself. Integers are
the common literal, so they get no Python hook: a scan of the raw bytes for a
run of more than ``MAX_JSON_NUMBER_CHARS`` digits/signs (inside strings too,
so it over-approximates) chooses between the hook-free parse and the hooked
one that names the literal. Floats and constants (rare) keep their hooks.
The cyclic garbage collector is paused while parsing: JSON makes no cycles,
and its passes over millions of fresh containers were most of the time.

It does not bound the file size (callers read with ``max_bytes``) and does
not know what the object means.

Example::

    obj = parse_json_object("ckpt/metadata.json", raw, fix="the file is corrupt or was cut short")
    num_ranks = expect_int(obj.get("num_ranks"), "ckpt/metadata.json: num_ranks", low=1)
"""

from __future__ import annotations

import gc
import json
import math
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np

from shardkit import knobs
from shardkit.errors import MetadataError

__all__ = ["parse_json_object", "gc_paused", "json_depth", "expect_int", "expect_str", "expect_list", "expect_dict",
           "short_repr", "NON_FINITE", "non_finite_name"]

#: The strings a NaN or infinite float is written as where JSON must hold it (JSON numbers cannot), and back.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def non_finite_name(value: float) -> str:
    """``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` for a float that is not finite (its ``NON_FINITE`` key)."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")

_SCAN_CHUNK_BYTES = 1 << 20
_DELTA = np.zeros(256, dtype=np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1
#: Every byte but quotes and brackets.
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'[]{}"')
#: Every byte that may be part of an integer literal maps to ``1``, every other byte to ``0``.
_INT_CHARS = bytes(49 if chr(b) in "0123456789-" else 48 for b in range(256))


class _Refused(ValueError):
    """A literal the limits refuse (raised inside the json hooks)."""


def parse_json_object(source: str, data: bytes, *, fix: str, max_depth: int | None = None,
                      object_hook: Callable[[dict], Any] | None = None, unique_keys: bool = False) -> dict:
    """The JSON object in ``data``; ``MetadataError`` naming ``source`` and ``fix`` otherwise.

    ``max_depth`` defaults to ``knobs.MAX_JSON_DEPTH``. ``object_hook`` is
    ``json.loads``'s: called on every object, innermost first, its result
    replaces the object (the outermost result must still be a ``dict``).
    ``unique_keys``: refuse an object that has a key twice, naming the key
    (``json.loads`` keeps the last silently, other readers may keep the
    first); off by default, as it costs a little per object.
    """
    limit = knobs.MAX_JSON_DEPTH if max_depth is None else max_depth
    depth = json_depth(data)
    if depth > limit:
        raise MetadataError(f"{source} nests arrays/objects {depth} deep; at most {limit} levels are "
                            f"accepted (knobs.MAX_JSON_DEPTH); {fix}")
    # The hook-free integer parse is safe only without long digit runs (then no literal is too long).
    int_hook = _parse_int if _has_run(data, knobs.MAX_JSON_NUMBER_CHARS + 1) else None
    try:
        with gc_paused():
            obj = json.loads(data.decode("utf-8"), parse_int=int_hook, parse_float=_parse_float,
                             parse_constant=_parse_constant, **_object_hooks(object_hook, unique_keys))
    except _Refused as e:
        raise MetadataError(f"{source} holds {e}; {fix}") from e
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise MetadataError(f"{source} is not valid JSON ({str(e)[:200]}); {fix}") from e
    if not isinstance(obj, dict):
        raise MetadataError(f"{source} holds a JSON {_JSON_KINDS.get(type(obj), 'value')}, expected an object; {fix}")
    return obj


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null", dict: "object"}


def _object_hooks(object_hook: Callable[[dict], Any] | None, unique_keys: bool) -> dict:
    """``json.loads`` keywords: ``object_hook`` as given, or behind a duplicate-key check (pairs hook)."""
    if not unique_keys:
        return {"object_hook": object_hook}

    def pairs_hook(pairs: list) -> Any:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            raise _Refused(f"the key {short_repr(_first_repeated_key(pairs))} twice in one object (readers "
                           f"disagree on which one counts)")
        return obj if object_hook is None else object_hook(obj)

    return {"object_pairs_hook": pairs_hook}


def _first_repeated_key(pairs: list) -> str:
    seen: set = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no repeated key")  # only called when dict(pairs) lost one


def _has_run(data: bytes, run_chars: int) -> bool:
    """Whether ``data`` holds ``run_chars`` integer characters (digits, ``-``) in a row (C speed, linear)."""
    return run_chars <= len(data) and b"1" * run_chars in data.translate(_INT_CHARS)


@contextmanager
def gc_paused():
    """No cyclic garbage collection inside the block (restored after; other threads are affected too).

    For short, CPU-bound blocks that build many container objects at once
    (parsing a large JSON document, rank 0 assembling a manifest): they would
    otherwise set off collections, and in a process that has imported torch a
    full one walks some 200,000 objects (0.12 s on the 2-core VM). The objects
    built are collected as usual once the block has ended. Not for blocks
    that may wait long (collectives, large I/O): other threads' cycles pile up meanwhile.

    Example::

        with gc_paused():
            doc = json.loads(text)
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def json_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside strings in JSON text ``data`` (linear time, bounded memory).

    Exact for valid JSON; for invalid JSON it may differ past the first error,
    which the parser reports anyway.

    >>> json_depth(b'{"a": [[1], "]]]"]}')
    3
    """
    if b"\\" in data:  # drop escaped backslashes, then escaped quotes: no quote in a string survives
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = data.translate(None, _NOT_STRUCTURAL)  # only quotes and brackets matter (a few times shorter)
    in_string, depth, deepest = 0, 0, 0
    for start in range(0, len(data), _SCAN_CHUNK_BYTES):
        chunk = np.frombuffer(data, np.uint8, min(_SCAN_CHUNK_BYTES, len(data) - start), start)
        quotes = np.cumsum(chunk == ord('"'), dtype=np.int64)
        outside = ((quotes + in_string) & 1) == 0
        # A closing quote counts as inside, an opening one as outside: neither is a bracket anyway.
        levels = depth + np.cumsum(_DELTA[chunk] * outside, dtype=np.int64)
        if len(levels):
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        in_string = (in_string + int(quotes[-1])) & 1 if len(quotes) else in_string
    return deepest


def _parse_int(text: str) -> int:
    if len(text) > knobs.MAX_JSON_NUMBER_CHARS:
        raise _Refused(f"an integer of {len(text)} digits (at most {knobs.MAX_JSON_NUMBER_CHARS} "
                       f"characters are accepted, knobs.MAX_JSON_NUMBER_CHARS)")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > knobs.MAX_JSON_NUMBER_CHARS:
        raise _Refused(f"a number literal of {len(text)} characters (at most {knobs.MAX_JSON_NUMBER_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]}, which overflows a float; only finite numbers are accepted")
    return value


def _parse_constant(text: str) -> float:
    raise _Refused(f"{text}, which is not JSON; only finite numbers are accepted")


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (for messages about untrusted values)."""
    text = repr(value) if not isinstance(value, (dict, list)) or len(value) < 8 else \
        f"<a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def expect_int(value: Any, what: str, *, low: int = 0, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``low..high`` (default high: ``knobs.MAX_TENSOR_DIM``)."""
    high = knobs.MAX_TENSOR_DIM if high is None else high
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MetadataError(f"{what} is {short_repr(value)}, expected an integer in {low}..{high}")
    return value


def expect_str(value: Any, what: str, *, max_chars: int | None = None) -> str:
    """``value`` if it is a str of at most ``max_chars`` (default ``knobs.MAX_NAME_CHARS``) characters."""
    max_chars = knobs.MAX_NAME_CHARS if max_chars is None else max_chars
    if not isinstance(value, str) or len(value) > max_chars:
        raise MetadataError(f"{what} is {short_repr(value)}, expected a string of at most {max_chars} characters")
    return value


def expect_list(value: Any, what: str, *, max_items: int | None = None) -> list:
    """``value`` if it is a JSON array of at most ``max_items`` items."""
    if not isinstance(value, list) or (max_items is not None and len(value) > max_items):
        limit = "" if max_items is None else f" of at most {max_items} items"
        raise MetadataError(f"{what} is {short_repr(value)}, expected an array{limit}")
    return value


def expect_dict(value: Any, what: str) -> dict:
    """``value`` if it is a JSON object."""
    if not isinstance(value, dict):
        raise MetadataError(f"{what} is {short_repr(value)}, expected an object")
    return value

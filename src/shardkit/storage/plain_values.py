"""Plain values (the non-tensor leaves of a state) as ``metadata.json``'s ``objects`` holds them, and back.

The one codec of plain values: every writer of shardkit's format
(``save``, ``async_save``, the manager, ``save_distributed``, ``convert`` and
``reshard``) encodes ``objects`` with :func:`encode_value` when it writes
``metadata.json``, every reader decodes them with :func:`decode_value` when it
parses it, and :func:`checked_value` is what a save accepts as a leaf (it
refuses the rest before anything is written). JSON's own values are stored as
themselves, as every format version did; a NaN or infinite float, ``bytes``,
``bytearray``, a numpy scalar and an int too long for a JSON literal are a JSON
object of one key naming the type (``{"bytes": "aGk="}``). A plain value is
never a JSON object itself (dicts are the structure), so no user value can be
taken for an encoded one, and a file of an earlier version decodes unchanged.
``metadata.json`` stays strict JSON (no bare ``NaN``). Layout in
``docs/format.md`` ("How each plain value is stored").

It does not flatten states (``checkpoint.format.nested``) or read files.

Example::

    raw = encode_value(np.float32(1.5))          # {"numpy.float32": 1.5}
    decode_value(raw, "metadata.json: object 'x'")  # np.float32(1.5)
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Callable

import numpy as np

from shardkit import knobs
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.storage.json_io import NON_FINITE, non_finite_name, short_repr

__all__ = ["NUMPY_SCALAR_DTYPES", "checked_value", "encode_value", "decode_value", "encode_objects"]

#: The numpy scalar dtypes a plain value may have, kept as that dtype (tag ``"numpy.<name>"``).
NUMPY_SCALAR_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                       "float16", "float32", "float64")
_NUMPY_TYPES = {name: np.dtype(name).type for name in NUMPY_SCALAR_DTYPES}


def checked_value(value: Any, what: str) -> Any:
    """``value`` as a save keeps it (a ``bytearray`` copied), if ``objects`` can hold it; else an error naming ``what``.

    Held: None, bool, int, float (NaN and infinities too), str, bytes, bytearray
    (at most ``knobs.MAX_BYTES_VALUE`` bytes) and numpy scalars of
    ``NUMPY_SCALAR_DTYPES``. Anything else raises ``TypeError`` (nothing is
    pickled); bytes over the limit raise :class:`TensorMismatchError` saying to
    store them as a uint8 tensor. Does not encode (:func:`encode_value` does).

    >>> checked_value(float("inf"), "best_loss")
    inf
    """
    if isinstance(value, np.generic) and not isinstance(value, (str, bytes)):
        if value.dtype.name in _NUMPY_TYPES:
            return value
        raise TypeError(f"state leaf {what!r} is a numpy {value.dtype.name} scalar; shardkit keeps numpy scalars "
                        f"of {', '.join(NUMPY_SCALAR_DTYPES)}. Convert it (e.g. float(x), or a tensor)")
    if isinstance(value, (bytes, bytearray)):
        if len(value) > knobs.MAX_BYTES_VALUE:
            raise TensorMismatchError(
                f"state leaf {what!r} is {len(value):,} bytes; plain values live in metadata.json, which keeps "
                f"bytes of at most {knobs.MAX_BYTES_VALUE:,} (knobs.MAX_BYTES_VALUE). Store it as a uint8 tensor "
                f"(torch.frombuffer(bytearray(b), dtype=torch.uint8); bytes(t.numpy()) after loading)")
        return bytearray(value) if isinstance(value, bytearray) else value
    if isinstance(value, int) and not isinstance(value, bool):
        _int_text(value, what)
        return value
    if value is None or isinstance(value, (bool, float, str)):
        return value
    raise TypeError(f"state leaf {what!r} is a {type(value).__name__}; shardkit saves tensors, dicts, lists, tuples "
                    f"and int/float/bool/str/None/bytes/numpy scalars, and never pickles. Convert it (e.g. to a "
                    f"tensor or a dict)")


def _int_text(value: int, what: str) -> str:
    try:
        return int.__repr__(value)
    except ValueError as e:  # past Python's int/str conversion limit (4300 digits by default)
        raise TensorMismatchError(f"state leaf {what!r} is an int of {value.bit_length()} bits, too long to write "
                                  f"as decimal ({e}); store it as a tensor or a str") from e


def encode_value(value: Any) -> Any:
    """The JSON form of a plain value (one :func:`checked_value` keeps) in ``metadata.json``'s ``objects``.

    JSON's own values are themselves (an int of up to ``knobs.MAX_JSON_NUMBER_CHARS``
    characters, a finite float, str, bool, null). Every other value is an
    object of one key naming its type: ``{"float": "NaN"|"Infinity"|"-Infinity"}``,
    ``{"bytes": base64}``, ``{"bytearray": base64}``, ``{"int": decimal}``,
    ``{"numpy.<dtype>": number|bool|"NaN"|...}``. No plain value is a JSON
    object itself (dicts are the structure), so none can be taken for one.
    :func:`decode_value` is the inverse. ``TypeError`` for a value not held.

    >>> encode_value(b"hi"), encode_value(float("-inf")), encode_value(np.float32(1.5))
    ({'bytes': 'aGk='}, {'float': '-Infinity'}, {'numpy.float32': 1.5})
    """
    if isinstance(value, np.generic) and value.dtype.name in _NUMPY_TYPES:
        kind = value.dtype.kind
        payload = bool(value) if kind == "b" else int(value) if kind in "iu" else _float_json(float(value))
        return {f"numpy.{value.dtype.name}": payload}
    if isinstance(value, (bytes, bytearray)):
        return {"bytearray" if isinstance(value, bytearray) else "bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": non_finite_name(value)}
    if isinstance(value, int) and not isinstance(value, bool):
        text = _int_text(value, "a plain value")
        return value if len(text) <= knobs.MAX_JSON_NUMBER_CHARS else {"int": text}
    if value is None or isinstance(value, (bool, float, str)):
        return value
    raise TypeError(f"a plain value of type {type(value).__name__} cannot be written to metadata.json")


def _float_json(value: float) -> Any:
    return value if math.isfinite(value) else non_finite_name(value)


def decode_value(raw: Any, what: str) -> Any:
    """The value the JSON ``raw`` (an ``objects`` entry) stands for: :func:`encode_value`'s inverse.

    Checks untrusted input: anything but a JSON value or a one-key object of
    a known type with a well-formed payload raises :class:`MetadataError`
    naming ``what`` (a type this shardkit does not know: upgrade shardkit).

    >>> decode_value({"numpy.int64": 3}, "step"), decode_value("nan", "s")
    (np.int64(3), 'nan')
    """
    if raw is None or isinstance(raw, (bool, int, float, str)):
        return raw
    if not (isinstance(raw, dict) and len(raw) == 1):
        raise MetadataError(f"{what} is {short_repr(raw)}; a plain value is a JSON number, string, boolean, null or "
                            f'an object of one key naming its type ({{"bytes": "..."}})')
    (tag, payload), = raw.items()
    decode = _DECODERS.get(tag) or (_decode_numpy if tag in _NUMPY_BY_TAG else None)
    if decode is None:
        raise MetadataError(f"{what} is a value of type {short_repr(tag)}, which this shardkit does not know "
                            f"(known: {', '.join([*_DECODERS, 'numpy.<dtype>'])}): a newer shardkit wrote it "
                            f"(upgrade shardkit to read it), or the file is damaged")
    value = decode(tag, payload)
    if value is _BAD:
        raise MetadataError(f"{what} is {short_repr(raw)}, not a well-formed {tag!r} value (docs/format.md)")
    return value


_BAD = object()
_NUMPY_BY_TAG = {f"numpy.{name}": t for name, t in _NUMPY_TYPES.items()}


def _decode_float(tag: str, payload: Any) -> Any:
    return NON_FINITE[payload] if isinstance(payload, str) and payload in NON_FINITE else _BAD


def _decode_bytes(tag: str, payload: Any) -> Any:
    if not isinstance(payload, str):
        return _BAD
    try:
        data = base64.b64decode(payload, validate=True)  # only the base64 alphabet, padded
    except (binascii.Error, ValueError):  # ValueError: a character that is not ASCII
        return _BAD
    return bytearray(data) if tag == "bytearray" else data


def _decode_int(tag: str, payload: Any) -> Any:
    if not (isinstance(payload, str) and payload.lstrip("-").isdigit() and payload.isascii()):
        return _BAD
    try:
        return int(payload)
    except ValueError:  # past Python's int/str conversion limit
        return _BAD


def _decode_numpy(tag: str, payload: Any) -> Any:
    scalar = _NUMPY_BY_TAG[tag]
    kind = np.dtype(scalar).kind
    if kind == "b":
        return scalar(payload) if isinstance(payload, bool) else _BAD
    if isinstance(payload, bool):
        return _BAD
    if kind in "iu":
        info = np.iinfo(scalar)
        return scalar(payload) if isinstance(payload, int) and info.min <= payload <= info.max else _BAD
    number = NON_FINITE.get(payload) if isinstance(payload, str) else payload
    if not isinstance(number, (int, float)):
        return _BAD
    too_large = math.isfinite(number) and abs(number) > float(np.finfo(scalar).max)  # it would come back inf
    return _BAD if too_large else scalar(number)


_DECODERS: dict[str, Callable[[str, Any], Any]] = {"float": _decode_float, "bytes": _decode_bytes,
                                                  "bytearray": _decode_bytes, "int": _decode_int}


def encode_objects(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` (plain values by name) in their JSON form, as ``metadata.json`` holds them."""
    return {name: encode_value(value) for name, value in objects.items()}

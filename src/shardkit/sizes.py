"""Sizes written by people (``"5GB"``, ``"512MiB"``, ``1000``) in bytes, read as ``transformers`` reads them.

One parser for every size shardkit takes: ``max_shard_size`` of the
Hugging Face writers, ``shardkit convert --max-shard-size`` and
``shardkit bench --size``. ``"2GiB"``/``"MiB"``/``"KiB"`` are powers of 2,
``"5GB"``/``"MB"``/``"KB"`` powers of 10 (any case), a lower-case final ``b``
(``"8Mb"``) means bits, as in ``transformers.utils.hub.convert_file_size_to_int``.
What it does not do: fractions (``"1.5GB"``: write ``"1500MB"``), or pass a
bool, a float or None through (``transformers`` does; here they raise).

>>> size_bytes("5GB"), size_bytes("2GiB"), size_bytes(1000), size_bytes("1000")
(5000000000, 2147483648, 1000, 1000)
"""

from __future__ import annotations

from typing import Union

from shardkit.errors import MetadataError

__all__ = ["size_bytes"]

_BINARY_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10}
_DECIMAL_UNITS = {"GB": 10**9, "MB": 10**6, "KB": 10**3}


def size_bytes(size: Union[int, str], *, what: str = "size") -> int:
    """``size`` in bytes: an int as is, or a string as ``transformers`` reads it; ``what`` names the
    argument in the :class:`MetadataError` a size that is none raises."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    if isinstance(size, str):
        if size.strip().isascii() and size.strip().isdigit():  # "1000": bytes (a command line's)
            return int(size)
        upper = size.upper()
        for unit, scale in _BINARY_UNITS.items():
            if upper.endswith(unit):
                return _leading_int(size, len(unit), what) * scale
        for unit, scale in _DECIMAL_UNITS.items():
            if upper.endswith(unit):
                nbytes = _leading_int(size, len(unit), what) * scale
                return nbytes // 8 if size.endswith("b") else nbytes
    raise MetadataError(f"{what} must be a number of bytes or a size such as '5GB', '500MB' or '2GiB'; "
                        f"got {size!r} ({type(size).__name__})")


def _leading_int(size: str, unit_chars: int, what: str) -> int:
    try:
        return int(size[:-unit_chars])
    except ValueError as e:
        raise MetadataError(f"{what} {size!r}: {size[:-unit_chars]!r} is not a whole number; write e.g. "
                            f"'1500MB' instead of '1.5GB'") from e

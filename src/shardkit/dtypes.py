"""The dtype table: torch dtypes and their safetensors names.

Only dtypes that both torch (this version) and safetensors know are listed;
a dtype missing from either raises :class:`~shardkit.errors.TensorMismatchError`
naming the supported ones. This module does no I/O.

Example::

    >>> to_safetensors_name(torch.bfloat16)
    'BF16'
    >>> from_safetensors_name("F8_E4M3")
    torch.float8_e4m3fn
"""

from __future__ import annotations

import torch

from shardkit.errors import TensorMismatchError

__all__ = [
    "NAME_TO_DTYPE",
    "DTYPE_TO_NAME",
    "to_safetensors_name",
    "from_safetensors_name",
    "itemsize_bytes",
]


def _build_table() -> dict[str, torch.dtype]:
    candidates = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "I32": "int32",
        "I64": "int64",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    # Older torch releases lack some of these; keep what this one has.
    return {name: getattr(torch, attr) for name, attr in candidates.items() if hasattr(torch, attr)}


NAME_TO_DTYPE: dict[str, torch.dtype] = _build_table()
DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in NAME_TO_DTYPE.items()}


def to_safetensors_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise TensorMismatchError(
            f"dtype {dtype} cannot be stored in safetensors; supported: "
            f"{', '.join(str(d) for d in DTYPE_TO_NAME)}. Convert the tensor first "
            f"(e.g. tensor.to(torch.float32))."
        ) from None


def from_safetensors_name(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name (``"F32"`` -> ``torch.float32``)."""
    try:
        return NAME_TO_DTYPE[name]
    except KeyError:
        raise TensorMismatchError(
            f"unknown safetensors dtype {name!r}; this torch supports: "
            f"{', '.join(NAME_TO_DTYPE)}"
        ) from None


def itemsize_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize

"""Refusals a Hugging Face save makes before it touches the output directory.

A save first removes the previous checkpoint's index and shards, so anything
that would make it fail half-way (a tensor no shard format can hold, metadata
JSON cannot hold) or succeed with files shardkit's own loaders refuse (NaN in
the index, a tensor named ``__metadata__``) is refused here, up front, with a
typed error naming the entry, what was found and how to fix it. This module
reads and writes no files.

Example::

    check_savable_tensors({"w": torch.ones(2)}, safetensors=True)       # passes
    json_problem({"step": numpy.int64(5)}, "metadata")                 # "metadata['step'] is a numpy.int64 ..."
"""

from __future__ import annotations

import functools
import io
import math
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from shardkit import knobs
from shardkit.dtypes import DTYPE_TO_NAME
from shardkit.errors import TensorMismatchError
from shardkit.storage.json_io import short_repr

__all__ = ["RESERVED_TENSOR_NAME", "check_savable_tensors", "check_export_dtype", "json_problem"]

#: The key a safetensors header keeps its string metadata under; a tensor of that name would replace it.
RESERVED_TENSOR_NAME = "__metadata__"


def check_savable_tensors(sd: Dict[str, Tensor], safetensors: bool) -> None:
    """Raise :class:`TensorMismatchError` for the first tensor the chosen format cannot store.

    Refused: a meta-device tensor (it has no data), a non-dense one (sparse,
    mkldnn, nested), and a dtype safetensors (``safetensors=True``) or
    ``torch.save`` (``.bin``) cannot hold. Does not check names or shapes.
    """
    for name, tensor in sd.items():
        problem = _tensor_problem(tensor, safetensors)
        if problem:
            raise TensorMismatchError(f"tensor {name!r} {problem}. Nothing was written.")


def check_export_dtype(dtype: object, safetensors: bool) -> None:
    """Raise :class:`TensorMismatchError` unless ``dtype`` (``save_checkpoint(dtype=...)``) is None or a
    floating ``torch.dtype`` the chosen format stores: floating tensors are cast to it, others kept."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TensorMismatchError(
            f"dtype={dtype!r}: an export casts its floating tensors to a floating torch.dtype (integer tensors keep "
            f"theirs); pass e.g. torch.bfloat16 or torch.float16, or None to keep every dtype. Nothing was written.")
    if safetensors and dtype not in DTYPE_TO_NAME:
        raise TensorMismatchError(f"dtype={dtype}: safetensors cannot store it; pass e.g. torch.bfloat16. "
                                  f"Nothing was written.")


def _tensor_problem(tensor: Tensor, safetensors: bool) -> Optional[str]:
    if tensor.is_meta:
        return ("is on the meta device: it has no data to save. Materialise the module first "
                "(to_empty(device=...) + load its weights, or build/load it on CPU)")
    if tensor.layout != torch.strided or tensor.is_nested:
        kind = "nested" if tensor.is_nested else str(tensor.layout)
        return (f"has layout {kind}; only dense (strided) tensors can be saved. Convert it first "
                f"(tensor.to_dense()), or keep it out of the state dict")
    if safetensors:
        return None if tensor.dtype in DTYPE_TO_NAME else (
            f"has dtype {tensor.dtype}, which safetensors cannot store (it stores "
            f"{', '.join(str(d).removeprefix('torch.') for d in DTYPE_TO_NAME)}). Convert it first "
            f"(e.g. tensor.to(torch.complex64) or torch.view_as_real(tensor) for complex128), or save with "
            f"safetensors=False (.bin)")
    if not _bin_can_hold(tensor.dtype):
        return (f"has dtype {tensor.dtype}, which torch.save (.bin) cannot store. Convert it first "
                f"(e.g. tensor.to(torch.uint8) after packing)")
    return None


@functools.lru_cache(maxsize=None)
def _bin_can_hold(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` writes a tensor of ``dtype`` (sub-byte dtypes such as ``torch.uint4`` it refuses)."""
    try:
        probe = torch.empty(0, dtype=dtype)
    except Exception:  # noqa: BLE001 -- e.g. quantized dtypes need their own constructors; torch.save takes them
        return True
    try:
        torch.save(probe, io.BytesIO())
    except Exception:  # noqa: BLE001 -- torch raises KeyError/RuntimeError for dtypes it has no storage type for
        return False
    return True


def json_problem(value: Any, path: str, depth: int = 1) -> Optional[str]:
    """What in ``value`` strict JSON, as shardkit's loaders read it back, cannot hold; None if nothing.

    Refused: values that are not None/bool/int/float/str/list/tuple/dict
    (a numpy scalar, a tensor), NaN and infinities, integers longer than
    ``knobs.MAX_JSON_NUMBER_CHARS`` characters, nesting past
    ``knobs.MAX_JSON_DEPTH`` (``depth``: the level ``value`` sits at), dict
    keys JSON cannot write. The message names ``path`` and how to fix it.
    """
    if value is None or isinstance(value, (str, bool)):
        return None
    if isinstance(value, int):
        return None if _int_fits(value) else (
            f"{path} is an integer of {value.bit_length()} bits; the loaders accept number literals of at most "
            f"{knobs.MAX_JSON_NUMBER_CHARS} characters (knobs.MAX_JSON_NUMBER_CHARS). Store it as a string (str(x))")
    if isinstance(value, float):
        return None if math.isfinite(value) else (
            f"{path} is {value!r}; JSON has no NaN or Infinity and shardkit's loaders (like strict JSON readers) "
            f"refuse them. Store None or a string such as {str(value)!r} instead, or leave it out")
    if isinstance(value, (list, tuple, dict)) and depth > knobs.MAX_JSON_DEPTH:
        return (f"{path} nests more than {knobs.MAX_JSON_DEPTH} levels deep (knobs.MAX_JSON_DEPTH), or refers to "
                f"itself; the loaders refuse that. Flatten it")
    if isinstance(value, (list, tuple)):
        return _first_problem((json_problem(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)))
    if isinstance(value, dict):
        return _first_problem((_key_problem(k, path) or json_problem(v, f"{path}[{k!r}]", depth + 1))
                              for k, v in value.items())
    return (f"{path} is a {type(value).__module__}.{type(value).__qualname__} ({short_repr(value)}), which JSON "
            f"cannot hold. Pass a plain Python value instead: int(x), float(x), str(x), or x.tolist() for an array "
            f"or tensor")


def _key_problem(key: Any, path: str) -> Optional[str]:
    if key is None or isinstance(key, (str, int)) or (isinstance(key, float) and math.isfinite(key)):
        return None
    return (f"{path} has the key {short_repr(key)} ({type(key).__name__}); JSON object keys must be strings. "
            f"Use str(key)")


def _first_problem(problems) -> Optional[str]:
    return next((p for p in problems if p), None)


def _int_fits(value: int) -> bool:
    """Whether ``str(value)`` has at most ``knobs.MAX_JSON_NUMBER_CHARS`` characters (without building it)."""
    limit = knobs.MAX_JSON_NUMBER_CHARS
    return -(10 ** (limit - 1)) < value < 10**limit

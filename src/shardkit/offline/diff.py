"""Compare two checkpoints of any kind shardkit reads (distributed, HF, DCP), one tensor at a time.

Reports names only in one, shape or dtype changes, and for every common
tensor whether it is identical: from checksums without reading where both
sides carry comparable ones (two distributed checkpoints), else by reading
both tensors (one pair at a time) and computing the largest absolute
difference and the largest relative one, ``max|a - b| / max|a|``. Non-tensor
values are compared too: numbers by value (``1`` equals ``1.0``), anything
else (a DCP's bytes, sets, dtypes, tensors inside tuples) by type and value.
Every tensor it reads from a shardkit checkpoint is verified block by block
(a damaged one raises ``ChecksumError``: the CLI's exit 2); tensors judged
identical from their recorded checksums are not read, so not verified
(``verify=True`` / ``--verify`` reads them).

Example::

    report = diff_checkpoints("ckpt/step-100", "hf/step-100")
    print(report.identical, report.changed[:3])
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

__all__ = ["DiffReport", "TensorDiff", "diff_checkpoints", "tensor_difference"]

log = logging.getLogger("shardkit.offline")


@dataclass
class TensorDiff:
    name: str
    status: str                       # "identical" | "different" | "shape" | "dtype"
    how: str = ""                     # "checksum" | "read" | what changed
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None


@dataclass
class DiffReport:
    a: str
    b: str
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)
    tensors: list = field(default_factory=list)          # TensorDiff per common name
    values: dict = field(default_factory=dict)           # plain values that differ: name -> [a, b]

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.values or any(t.status != "identical" for t in self.tensors))

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical, "only_in_a": self.only_a,
                "only_in_b": self.only_b, "tensors": [asdict(t) for t in self.tensors], "values": self.values}


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(max |a - b|, max |a - b| / max |a|)`` (0 relative when both are all zero; inf when only ``a`` is)."""
    if a.numel() == 0:
        return 0.0, 0.0
    a, b = _widened(a, b)
    delta = (a - b).abs().max().item()
    scale = a.abs().max().item()
    if math.isnan(delta):
        return math.nan, math.nan
    rel = 0.0 if delta == 0 else (delta / scale if scale > 0 else math.inf)
    return float(delta), float(rel)


def _widened(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as float64 (complex128 if either is complex), whatever their dtypes (bool, int, fp8)."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    return tuple((t.to(torch.uint8) if t.dtype == torch.bool else t).to(wide) for t in (a, b))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, or equal values where NaN equals only NaN (any payload) and ``-0.0`` equals ``0.0``;
    ``inf`` equals only ``inf`` of the same sign. A complex element compares its two parts apart."""
    if torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    wa, wb = _widened(a, b)
    if wa.is_complex():
        wa, wb = torch.view_as_real(wa), torch.view_as_real(wb)
    nan_a = wa.isnan()
    return torch.equal(nan_a, wb.isnan()) and bool((nan_a | (wa == wb)).all())


def _same_value(x, y) -> bool:
    """Two values equal (NaN equal to NaN): plain values, and what a DCP keeps beside them (bytes,
    complex, sets, dtypes, tensors inside tuples: same type, and a tensor same dtype, shape and values)."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and _same_values(x.cpu(), y.cpu()))
    if isinstance(x, (float, complex, np.floating)) and type(x) is type(y):  # np.float32 NaN too
        return all(p == q or (math.isnan(p) and math.isnan(q)) for p, q in zip(_parts(x), _parts(y)))
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same_value, x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    return (type(x) is type(y) or _numbers(x, y)) and bool(x == y)


def _parts(z: float | complex) -> tuple[float, float]:
    return (z.real, z.imag) if isinstance(z, complex) else (z, 0.0)


def _numbers(x, y) -> bool:
    """Both bool, int or float (a JSON value read back may change among them: ``1`` vs ``1.0``)."""
    return all(isinstance(v, (bool, int, float)) for v in (x, y))


def diff_checkpoints(a: str, b: str, *, kind_a: Optional[str] = None, kind_b: Optional[str] = None,
                     progress: Optional[Callable[[int], None]] = None, verify: bool = False) -> DiffReport:
    """The :class:`DiffReport` of checkpoints ``a`` and ``b`` (memory: one pair of tensors).

    Tensors whose recorded checksums match are reported identical without
    reading a byte (``how="checksum"``): a copy damaged after it was saved
    still matches its record. ``verify=True`` reads every common tensor of
    both instead (a damaged file then raises ``ChecksumError``).
    """
    from shardkit.sources import open_source

    report = DiffReport(a, b)
    with open_source(a, kind_a) as src_a, open_source(b, kind_b) as src_b:
        ta, tb = src_a.tensors(), src_b.tensors()
        report.only_a = sorted(set(ta) - set(tb))
        report.only_b = sorted(set(tb) - set(ta))
        for name in sorted(set(ta) & set(tb)):
            report.tensors.append(_compare(name, ta[name], tb[name], src_a, src_b, verify))
            if progress is not None:
                progress(ta[name].nbytes)
        oa, ob = _leaves(_values(src_a)), _leaves(_values(src_b))
        report.values = {n: [oa.get(n), ob.get(n)] for n in sorted(set(oa) | set(ob))
                         if n not in oa or n not in ob or not _same_value(oa[n], ob[n])}
    return report


def _values(src) -> dict:
    """Every non-tensor value ``src`` keeps: all of a DCP's (bytes, sets, dtypes too), other kinds' plain ones."""
    from shardkit.sources.readers import DcpSource

    return src.all_values() if isinstance(src, DcpSource) else src.objects()


def _leaves(values: dict) -> dict:
    """``values`` with every non-empty list, tuple and dict split into dotted leaves (``betas.0``), as
    shardkit's own save names them: a value a DCP keeps whole (AdamW's ``betas`` tuple) and the same
    value a converted checkpoint keeps leaf by leaf compare equal, and a difference is named by its
    leaf. An empty container stays a leaf of its own."""
    out: dict = {}

    def walk(name: str, value) -> None:
        if isinstance(value, (list, tuple)) and value:
            for i, item in enumerate(value):
                walk(f"{name}.{i}", item)
        elif isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{name}.{key}", item)
        else:
            out[name] = value

    for name, value in values.items():
        walk(name, value)
    return out


def _compare(name, ia, ib, src_a, src_b, verify: bool = False) -> TensorDiff:
    if tuple(ia.shape) != tuple(ib.shape):
        return TensorDiff(name, "shape", f"{list(ia.shape)} -> {list(ib.shape)}")
    if ia.dtype != ib.dtype:
        how = f"{str(ia.dtype).replace('torch.', '')} -> {str(ib.dtype).replace('torch.', '')}"
        a, b = src_a.read(name), src_b.read(name)
        abs_d, rel_d = tensor_difference(a, b)  # both widened: the figures do not depend on which side is A
        return TensorDiff(name, "dtype", how, abs_d, rel_d)
    if not verify and ia.checksum is not None and ia.checksum == ib.checksum:
        return TensorDiff(name, "identical", "checksum")
    a, b = src_a.read(name), src_b.read(name)
    log.debug("compared %s by reading (%d bytes each)", name, ia.nbytes)
    if _same_values(a, b):
        return TensorDiff(name, "identical", "read", 0.0, 0.0)
    abs_d, rel_d = tensor_difference(a, b)
    return TensorDiff(name, "different", "read", abs_d, rel_d)

"""Compare two checkpoints of any kind shardkit reads (distributed, HF, DCP), one tensor at a time.

Reports names only in one, shape or dtype changes, and for every common
tensor whether it is identical: from checksums without reading where both
sides carry comparable ones (two distributed checkpoints), else by reading
both tensors (one pair at a time) and computing the largest absolute
difference and the largest relative one, ``max|a - b| / max|a|``. It does
not compare plain values' types, only their equality.

Example::

    report = diff_checkpoints("ckpt/step-100", "hf/step-100")
    print(report.identical, report.changed[:3])
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

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
    """Equal bytes, or equal values with NaNs where the other has NaNs (``-0.0`` equals ``0.0``)."""
    if torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    wa, wb = _widened(a, b)
    return torch.equal(wa.isnan(), wb.isnan()) and torch.equal(wa.nan_to_num(), wb.nan_to_num())


def _same_plain(x, y) -> bool:
    """Plain values equal, NaN equal to NaN (a float value that is NaN in both is not a change)."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same_plain, x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_plain(x[k], y[k]) for k in x)
    return x == y


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
        oa, ob = src_a.objects(), src_b.objects()
        report.values = {n: [oa.get(n), ob.get(n)] for n in sorted(set(oa) | set(ob))
                         if n not in oa or n not in ob or not _same_plain(oa[n], ob[n])}
    return report


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

"""Pure helpers of the demo: compare loss curves, describe checkpoint directories, format the summary.

No torch, no processes: unit-tested on their own (tests/test_demo.py).

Example::

    >>> first_mismatch({8: 1.5, 9: 1.25}, [0.0] * 8 + [1.5, 1.25])
    >>> first_mismatch({8: 1.5}, [0.0] * 8 + [1.0])
    (8, 1.5, 1.0)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def first_mismatch(losses: dict, reference: list) -> tuple | None:
    """The first ``(step, got, expected)`` where ``losses`` differs from ``reference`` by any bit; None if none.

    A step of ``losses`` that ``reference`` does not have counts as a mismatch
    (expected None). Python floats hold the float32 losses exactly, so ``!=``
    is a bit-for-bit comparison (NaN never equals).
    """
    for step in sorted(losses):
        expected = reference[step] if 0 <= step < len(reference) else None
        if expected is None or losses[step] != expected:
            return step, losses[step], expected
    return None


def step_dirs(root: str) -> list[str]:
    """The ``step-<n>`` entries of ``root``, ordered by step."""
    names = [n for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()]
    return sorted(names, key=lambda n: int(n[5:]))


def steps_text(steps: list) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``; ``[]`` -> ``"none"``."""
    if not steps:
        return "none"
    runs, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


@dataclass
class Summary:
    """What happened, phase by phase, and which checks passed; ``lines()`` formats it."""

    phases: list = field(default_factory=list)      # (name, what, seconds)
    checks: list = field(default_factory=list)      # (name, ok, what)

    def phase(self, name: str, what: str, seconds: float) -> None:
        self.phases.append((name, what, seconds))

    def check(self, name: str, ok: bool, what: str) -> bool:
        self.checks.append((name, bool(ok), what))
        return bool(ok)

    def failed(self) -> list[str]:
        return [name for name, ok, _ in self.checks if not ok]

    def lines(self, total_s: float) -> list[str]:
        out = ["summary:"]
        out += [f"  {name:<9} {seconds:6.1f} s  {what}" for name, what, seconds in self.phases]
        out += [f"  {'total':<9} {total_s:6.1f} s"]
        out += ["checks:"]
        out += [f"  {'ok  ' if ok else 'FAIL'} {name}: {what}" for name, ok, what in self.checks]
        bad = self.failed()
        out.append("demo: every check passed" if not bad else f"demo: FAILED check(s): {', '.join(bad)}")
        return out

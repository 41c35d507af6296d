"""The crossing rule: when a run's curve reaches a target, the way docs/speedup.md defines it.

A run's curve is a list of evaluations {"step", "samples", "flops", "wall_s", "cpu_s", <metric>: value, ...} at
increasing steps. For a target value of a metric, the crossing is the first evaluation i at which the metric reaches
the target and the next one (`sustain` = 2) does too (the last evaluation counts alone); the cost at the crossing is
interpolated linearly between evaluation i-1 and i at the fraction where the metric meets the target (every cost is
linear in steps between evaluations). A run that never crosses has no crossing (None).

The protocol built on it (the target as baseline A's plateau, the per-seed gate, censoring at the full budget, the
paired speedups and their intervals over seeds and captions) is analysis.py's.
"""

from __future__ import annotations

import math

COSTS = ("step", "samples", "flops", "wall_s", "cpu_s")
# Metric -> True when higher is better.
DIRECTION = {"align_overall": True, "align_exact": True, "kid": False, "fd_shapes": False, "fd_dinov2": False,
             "vloss": False}  # fmt: skip
SUSTAIN = 2


def _ok(value: float, target: float, higher: bool) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value >= target if higher else value <= target


def crossing(curve: list[dict], metric: str, target: float, higher: bool = True, sustain: int = SUSTAIN) -> dict | None:
    """The interpolated costs (COSTS) at which `curve` first reaches `target` on `metric` and holds it for `sustain`
    evaluations (module docstring), or None when it never does."""
    vals = [p.get(metric, float("nan")) for p in curve]
    ok = [_ok(v, target, higher) for v in vals]
    for i in range(len(curve)):
        if all(ok[i : i + max(1, sustain)]):
            if i == 0:
                return {k: float(curve[0][k]) for k in COSTS}
            a, b = vals[i - 1], vals[i]
            frac = 1.0
            if math.isfinite(a) and b != a:
                frac = min(max((target - a) / (b - a), 0.0), 1.0)
            return {k: float(curve[i - 1][k] + frac * (curve[i][k] - curve[i - 1][k])) for k in COSTS}
    return None

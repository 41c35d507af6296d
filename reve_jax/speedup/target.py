"""Time to target and speedups, the way docs/speedup.md defines them.

A run's curve is a list of evaluations {"step", "samples", "flops", "wall_s", "cpu_s", <metric>: value, ...} at
increasing steps. For a target value of a metric:

- crossing: the first evaluation i at which the metric reaches the target and the next one (`sustain` = 2) does too
  (the last evaluation counts alone); the cost at the crossing is interpolated linearly between evaluation i-1 and
  i at the fraction where the metric meets the target (every cost is linear in steps between evaluations);
- censored: a run that never crosses is censored at its budget: its time is "> budget";
- the baseline's time is its full budget (its target is its own final value).

Speedups are paired within a seed: for seed s, target_s is baseline s's final value, and the speedup of a method
on cost k is baseline_s's budget cost / the method's cost to reach target_s. Over seeds the summary is the
geometric mean of the per-seed ratios with a bootstrap interval over seeds; a censored seed enters with its upper
bound (budget / budget), and the aggregate is then marked as an upper bound.
"""

from __future__ import annotations

import math

import numpy as np

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


def budget(curve: list[dict]) -> dict:
    """The costs of a whole run (its last evaluation)."""
    return {k: float(curve[-1][k]) for k in COSTS}


def bootstrap(values: list[float], stat=np.mean, n: int = 10_000, seed: int = 0, level: float = 0.95):
    """(statistic, low, high): `stat` of `values` and its percentile bootstrap interval over resamples of them.
    `stat(x, axis)` reduces an axis (np.mean, geomean): the `n` resamples are drawn as one [n, len(values)] array,
    the same draws, in the same order, as `n` successive resamples."""
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return (float("nan"),) * 3
    rng = np.random.default_rng(seed)
    draws = stat(v[rng.integers(0, len(v), (n, len(v)))], axis=1)
    lo, hi = np.percentile(draws, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(stat(v)), float(lo), float(hi)


def geomean(v, axis=None):
    """The geometric mean of `v` (over `axis`; all of it by default)."""
    return np.exp(np.mean(np.log(np.asarray(v, np.float64)), axis=axis))


def paired(runs: list[dict], baseline: str, metric: str = "align_overall", sustain: int = SUSTAIN) -> dict:
    """Per method: per-seed crossings of the seed's baseline final value, and speedups per cost with bootstrap
    intervals. `runs`: [{"method", "seed", "curve"}]. Returns {method: {"seeds", "reached", "per_seed": [...],
    "cost": {k: (mean, lo, hi)}, "speedup": {k: (geomean, lo, hi)}, "censored": bool}}."""
    higher = DIRECTION[metric]
    base = {r["seed"]: r for r in runs if r["method"] == baseline and r["curve"]}
    out = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        per_seed = []
        for r in (r for r in runs if r["method"] == method and r["curve"]):
            b = base.get(r["seed"])
            if b is None:
                continue
            target = b["curve"][-1].get(metric, float("nan"))
            hit = budget(r["curve"]) if method == baseline else crossing(r["curve"], metric, target, higher, sustain)
            cost = hit or budget(r["curve"])
            ratio = {k: budget(b["curve"])[k] / cost[k] if cost[k] > 0 else float("nan") for k in COSTS}
            per_seed.append({"seed": r["seed"], "target": target, "reached": hit is not None, "cost": cost,
                             "speedup": ratio})  # fmt: skip
        if not per_seed:
            continue
        row = {"seeds": len(per_seed), "reached": sum(p["reached"] for p in per_seed), "per_seed": per_seed}
        row["censored"] = row["reached"] < row["seeds"]
        row["cost"] = {k: bootstrap([p["cost"][k] for p in per_seed]) for k in COSTS}
        row["speedup"] = {k: bootstrap([p["speedup"][k] for p in per_seed], stat=geomean) for k in COSTS}
        out[method] = row
    return out


def finals(runs: list[dict], metrics: tuple[str, ...]) -> dict:
    """Per method and metric: (mean, lo, hi) of the final evaluation's value over seeds (bootstrap over seeds)."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method and r["curve"]]
        out[method] = {
            m: bootstrap([r["curve"][-1][m] for r in rs])
            for m in metrics
            if rs and all(m in r["curve"][-1] for r in rs)
        }
    return out


def gate(runs: list[dict], baseline: str, metric: str = "align_overall", min_final: float = 0.45,
         min_gain: float = 0.2) -> tuple[bool, str]:  # fmt: skip
    """Whether the baseline learned enough for a time to its final quality to mean anything: its final `metric`
    (mean over seeds) must reach `min_final` and exceed its first evaluation by `min_gain`. Returns (ok, why)."""
    curves = [r["curve"] for r in runs if r["method"] == baseline and r["curve"]]
    if not curves:
        return False, f"no {baseline} runs"
    final = float(np.mean([c[-1][metric] for c in curves]))
    gain = float(np.mean([c[-1][metric] - c[0][metric] for c in curves]))
    if final < min_final or gain < min_gain:
        return False, (
            f"no speedup measurable: the baseline ({baseline}) ends at {metric} {final:.3f} (needs >= {min_final}) "
            f"after gaining {gain:+.3f} over its first evaluation (needs >= {min_gain})"
        )
    return True, f"baseline ({baseline}) ends at {metric} {final:.3f}, {gain:+.3f} over its first evaluation"

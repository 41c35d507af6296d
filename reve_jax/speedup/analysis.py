"""The headline's statistics (docs/speedup.md): one target, one crossing rule for every method, a gate per seed,
and intervals that resample seeds and, within each evaluation, captions.

- target, per seed: baseline A's plateau, the mean of its last PLATEAU evaluations of the primary metric;
- time to target: the first evaluation at which a curve reaches the target and holds it for `sustain`
  evaluations (the last counts alone), interpolated between evaluations (target.crossing); the baseline is timed
  by the same rule against its own plateau; a run that never reaches it, or diverges, is censored at the full
  budget (its ratio is an upper bound, printed "<=");
- the gate, per seed: the baseline's plateau must reach `gate_final` and exceed its first evaluation by
  `gate_gain`; a failing seed is reported and left out; with fewer than MIN_SEEDS passing seeds there is no
  speedup to report ("no speedup measurable"); the plateau's own rise (`plateau_rise`, over the PLATEAU
  evaluations before it) is printed beside, so a budget too short to plateau shows in the report;
- the speedup of a method on a cost: per passing seed, the baseline's cost to its target over the method's; over
  seeds, their geometric mean. Its interval resamples the passing seeds and, within each evaluation of each drawn
  seed, the captions (the same draw for every run of that seed, so the pair stays paired; target and crossings
  recomputed on every resample) where the evaluations kept their per-caption checks. With fewer than CI_SEEDS
  seeds no interval is claimed: the per-seed values are printed, and their range;
- the factors of a 2x2 (`factors`: name, slower cell, faster cell): per passing seed, the slower cell's cost to the
  baseline's target over the faster cell's, their geometric mean and its interval from the same resamples (the
  ratio of the two cells' speedups, draw by draw). A seed where the faster cell is censored bounds the factor from
  above, one where the slower cell is censored from below; a factor with seeds of both kinds is no bound either way.
"""

from __future__ import annotations

import math

import numpy as np

from reve_jax.data.synthetic import alignment
from reve_jax.speedup.target import COSTS, DIRECTION, SUSTAIN, crossing

PLATEAU = 3  # evaluations averaged for the baseline's plateau
MIN_SEEDS = 3  # passing seeds below which no speedup is reported
CI_SEEDS = 5  # seeds from which an interval is claimed (with 3 seeds a "95%" bootstrap is the min and max)
LEVEL = 0.95


def plateau(values) -> float:
    v = np.asarray(values, np.float64)
    return float(np.mean(v[-PLATEAU:]))


def plateau_rise(values) -> float:
    """How far the plateau still rises: its mean over the mean of the PLATEAU evaluations before it (0 on a flat
    curve, in the metric's direction of travel on a climbing one); NaN with fewer than 2 x PLATEAU evaluations."""
    v = np.asarray(values, np.float64)
    if len(v) < 2 * PLATEAU:
        return math.nan
    return float(np.mean(v[-PLATEAU:]) - np.mean(v[-2 * PLATEAU : -PLATEAU]))


def full_budget(curve: list[dict], steps: int) -> dict:
    """The costs of the full budget of `steps` steps: the last evaluation's, scaled to `steps` where the curve was
    cut short (a diverged run is censored at the budget it would have trained, not where it stopped)."""
    last = curve[-1]
    scale = steps / last["step"] if last["step"] else 1.0
    return {k: float(last[k]) * (scale if last["step"] < steps else 1.0) for k in COSTS}


def time_to(curve, values, target: float, steps: int, higher: bool, sustain: int = SUSTAIN) -> tuple[dict, bool]:
    """(costs, reached): the costs at which `values` (the metric at each point of `curve`) first reaches `target`,
    or the full budget and False."""
    pts = [dict(p, _m=float(v)) for p, v in zip(curve, values, strict=True)]
    # A plateau of equal scores averages to a hair above them in floating point: reaching it is within rounding.
    tol = 1e-9 * max(1.0, abs(target))
    hit = crossing(pts, "_m", target - tol if higher else target + tol, higher, sustain)
    return (hit, True) if hit is not None else (full_budget(curve, steps), False)


# ---------------------------------------------------------------------------------------------------- per-caption
def _checks(curve: list[dict]) -> dict[str, np.ndarray] | None:
    """The evaluations' per-caption checks stacked: attribute -> int [E, N, 2], or None when any point lacks them."""
    if not curve or any("checks" not in p for p in curve):
        return None
    return {a: np.asarray([p["checks"][a] for p in curve], np.float64) for a in alignment.ATTRIBUTES}


def _resampled(checks: dict[str, np.ndarray], w: np.ndarray, metric: str) -> np.ndarray:
    """The alignment metric of every evaluation under caption counts w [R, N]: [R, E]."""
    per_attr = {a: np.einsum("rn,en->re", w, c[..., 0]) / np.maximum(np.einsum("rn,en->re", w, c[..., 1]), 1.0)
                for a, c in checks.items()}  # fmt: skip
    if metric == "align_overall":
        return np.mean(list(per_attr.values()), axis=0)
    if metric == "align_exact":
        exact = np.all([c[..., 0] == c[..., 1] for c in checks.values()], axis=0).astype(np.float64)  # [E, N]
        return np.einsum("rn,en->re", w, exact) / w.sum(1, keepdims=True)
    if metric.startswith("align_"):
        return per_attr[metric.removeprefix("align_")]
    raise ValueError(f"no per-caption resampling for {metric}")


# ---------------------------------------------------------------------------------------------------- analysis
def _seed_ratios(base_curve, base_vals, runs_vals, steps, higher, sustain):
    """For one seed: (target, baseline costs, {method: (costs, reached, ratios)})."""
    target = plateau(base_vals)
    base_cost, _ = time_to(base_curve, base_vals, target, steps, higher, sustain)
    out = {}
    for method, (curve, vals) in runs_vals.items():
        cost, reached = time_to(curve, vals, target, steps, higher, sustain)
        ratio = {k: base_cost[k] / cost[k] if cost[k] > 0 else math.nan for k in COSTS}
        out[method] = (cost, reached, ratio)
    return target, base_cost, out


def analyze(runs: list[dict], baseline: str, metric: str, steps: int, *, gate_final: float, gate_gain: float,
            sustain: int = SUSTAIN, n_boot: int = 1000, seed: int = 0, factors=()) -> dict:  # fmt: skip
    """The analysis of the module docstring. `runs`: [{"method", "seed", "curve"}] (points with COSTS, `metric`
    and optionally per-caption "checks"). Returns {"ok", "why", "metric", "gate": [per seed], "methods": {method:
    {"seeds", "reached", "per_seed": [{"seed", "cost", "reached", "speedup"}], "speedup": {cost: (center, lo,
    hi)}, "interval": "ci" | "range", "upper_bound"}}, "factors": [one per factor whose two cells ran on the same
    passing seeds: {"name", "slow", "fast", "seeds", "per_seed": [{"seed", "ratio", "bound"}], "ratio": {cost:
    (center, lo, hi)}, "interval", "bound"}]}; a bound is "upper", "lower", "none" (both censored, or seeds of both
    kinds) or None."""
    higher = DIRECTION[metric]
    by_seed: dict[int, dict[str, dict]] = {}
    for r in runs:
        if r.get("curve"):
            by_seed.setdefault(r["seed"], {})[r["method"]] = r
    gate, passing = [], []
    for s in sorted(by_seed):
        b = by_seed[s].get(baseline)
        if b is None:
            continue
        vals = [p[metric] for p in b["curve"]]
        top, gain = plateau(vals), plateau(vals) - vals[0]
        ok = top >= gate_final and gain >= gate_gain
        why = f"plateau {top:.3f} (needs >= {gate_final}), gain {gain:+.3f} over its first evaluation"
        why += f" (needs >= {gate_gain})"
        rise = plateau_rise(vals)
        if not math.isnan(rise):  # reported, never gated on: whether the budget was long enough is for the reader
            why += f"; {rise:+.3f} over the {PLATEAU} evaluations before it"
        gate.append({"seed": s, "ok": ok, "plateau": top, "gain": gain, "rise": rise, "why": why})
        if ok:
            passing.append(s)
    result = {"metric": metric, "baseline": baseline, "gate": gate, "methods": {}}
    if len(passing) < MIN_SEEDS:
        result.update(ok=False, why=f"no speedup measurable: the baseline ({baseline}) passes the gate on "
                      f"{len(passing)} of {len(gate)} seeds (needs {MIN_SEEDS})")  # fmt: skip
        return result
    result.update(ok=True, why=f"the baseline ({baseline}) passes the gate on {len(passing)} of {len(gate)} seeds")
    methods = list(dict.fromkeys(r["method"] for r in runs))
    point = {s: _seed_ratios(by_seed[s][baseline]["curve"], [p[metric] for p in by_seed[s][baseline]["curve"]],
                             {m: (r["curve"], [p[metric] for p in r["curve"]]) for m, r in by_seed[s].items()},
                             steps, higher, sustain) for s in passing}  # fmt: skip
    samples = _bootstrap(by_seed, passing, baseline, metric, steps, higher, sustain, n_boot, seed)
    for m in methods:
        per_seed = [{"seed": s, "target": point[s][0], "cost": point[s][2][m][0], "reached": point[s][2][m][1],
                     "speedup": point[s][2][m][2]} for s in passing if m in point[s][2]]  # fmt: skip
        if not per_seed:
            continue
        row = {"seeds": len(per_seed), "reached": sum(p["reached"] for p in per_seed), "per_seed": per_seed}
        row["upper_bound"] = row["reached"] < row["seeds"]
        row["interval"] = "ci" if len(per_seed) >= CI_SEEDS else "range"
        row["speedup"] = {}
        for k in COSTS:
            vals = np.array([p["speedup"][k] for p in per_seed])
            center = float(np.exp(np.mean(np.log(vals))))
            if row["interval"] == "range" or m not in samples:
                lo, hi = float(vals.min()), float(vals.max())
            else:
                lo, hi = (float(x) for x in np.percentile(samples[m][k], [50 * (1 - LEVEL), 50 * (1 + LEVEL)]))
            row["speedup"][k] = (center, lo, hi)
        result["methods"][m] = row
    result["factors"] = [f for f in (_factor(result["methods"], samples, *spec) for spec in factors) if f]
    return result


def _factor(rows: dict, samples: dict, name: str, slow: str, fast: str) -> dict | None:
    """One factor of a 2x2 (module docstring) from the two cells' rows and bootstrap samples; None unless both
    cells ran on the same passing seeds."""
    if slow not in rows or fast not in rows:
        return None
    a, b = ({p["seed"]: p for p in rows[m]["per_seed"]} for m in (slow, fast))
    if set(a) != set(b):
        return None
    per_seed = []
    for s in sorted(a):
        ratio = {k: b[s]["speedup"][k] / a[s]["speedup"][k] for k in COSTS}
        kind = {(True, True): None, (True, False): "upper", (False, True): "lower"}.get(
            (a[s]["reached"], b[s]["reached"]), "none"
        )
        per_seed.append({"seed": s, "ratio": ratio, "bound": kind})
    kinds = {p["bound"] for p in per_seed} - {None}
    interval = "ci" if len(per_seed) >= CI_SEEDS and slow in samples and fast in samples else "range"
    out = {}
    for k in COSTS:
        vals = np.array([p["ratio"][k] for p in per_seed])
        center = float(np.exp(np.mean(np.log(vals))))
        if interval == "ci":
            draws = np.asarray(samples[fast][k]) / np.asarray(samples[slow][k])
            lo, hi = (float(x) for x in np.percentile(draws, [50 * (1 - LEVEL), 50 * (1 + LEVEL)]))
        else:
            lo, hi = float(vals.min()), float(vals.max())
        out[k] = (center, lo, hi)
    bound = None if not kinds else kinds.pop() if len(kinds) == 1 else "none"
    return {"name": name, "slow": slow, "fast": fast, "seeds": len(per_seed), "per_seed": per_seed, "ratio": out,
            "interval": interval, "bound": bound}  # fmt: skip


def _bootstrap(by_seed, passing, baseline, metric, steps, higher, sustain, n_boot, seed) -> dict:
    """{method: {cost: [n_boot] geometric-mean speedups}} over resamples of the passing seeds and, where the
    evaluations kept per-caption checks, of each drawn seed's captions. Empty with fewer than CI_SEEDS seeds."""
    if len(passing) < CI_SEEDS or n_boot <= 0:
        return {}
    rng = np.random.default_rng(seed)
    k = len(passing)
    draws = rng.integers(0, k, (n_boot, k))  # slot j of resample b takes seed passing[draws[b, j]]
    curves: dict[int, dict[str, np.ndarray]] = {}  # seed -> method -> metric values [n_boot * k, E]
    for s in passing:
        runs = by_seed[s]
        checks = {m: _checks(r["curve"]) for m, r in runs.items()}
        curves[s] = {}
        if metric.startswith("align_") and all(c is not None for c in checks.values()):
            size = len(next(iter(checks[baseline].values()))[0])
            w = np.stack([np.bincount(rng.integers(0, size, size), minlength=size) for _ in range(n_boot * k)])
            for m, c in checks.items():
                curves[s][m] = _resampled(c, w.astype(np.float64), metric)
        else:  # seeds only
            for m, r in runs.items():
                curves[s][m] = np.tile([p[metric] for p in r["curve"]], (n_boot * k, 1))
    out: dict[str, dict[str, list]] = {}
    for b in range(n_boot):
        logs: dict[str, dict[str, list]] = {}
        for j in range(k):
            s, row = passing[draws[b, j]], b * k + j
            runs = by_seed[s]
            _, _, res = _seed_ratios(runs[baseline]["curve"], curves[s][baseline][row],
                                     {m: (r["curve"], curves[s][m][row]) for m, r in runs.items()},
                                     steps, higher, sustain)  # fmt: skip
            for m, (_, _, ratio) in res.items():
                for c in COSTS:
                    logs.setdefault(m, {}).setdefault(c, []).append(math.log(ratio[c]))
        for m, per_cost in logs.items():
            for c, v in per_cost.items():
                out.setdefault(m, {}).setdefault(c, []).append(math.exp(float(np.mean(v))))
    return {m: {c: np.asarray(v) for c, v in d.items()} for m, d in out.items()}


def finals(runs: list[dict], metrics: tuple[str, ...]) -> dict:
    """Per method and metric: each seed's final value (the mean of its last PLATEAU evaluations, as the target),
    their mean, and an interval (a bootstrap over seeds from CI_SEEDS seeds, else the range), with "interval"."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method and r["curve"]]
        row = {}
        for m in metrics:
            if not rs or not all(m in p for r in rs for p in r["curve"][-PLATEAU:]):
                continue
            vals = np.array([plateau([p[m] for p in r["curve"]]) for r in rs])
            if len(vals) >= CI_SEEDS:
                draws = vals[np.random.default_rng(0).integers(0, len(vals), (2000, len(vals)))].mean(1)
                lo, hi = np.percentile(draws, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
            else:
                lo, hi = vals.min(), vals.max()
            row[m] = {"per_seed": vals.tolist(), "mean": float(vals.mean()), "lo": float(lo), "hi": float(hi),
                      "interval": "ci" if len(vals) >= CI_SEEDS else "range"}  # fmt: skip
        out[method] = row
    return out

"""The checkpoint interval that maximises goodput, and the policies compared on one failure trace.

Young (1974): with a checkpoint costing C seconds and failures every M seconds on average, the compute time
between checkpoints that wastes least is sqrt(2 C M): each checkpoint costs C, each failure loses half an
interval on average. Daly (2006) adds the higher-order terms (failures during checkpoints and restarts):
sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C, for C < 2M.

`recommend` finds the interval by simulation instead: a coarse sweep by factors of 2 around Young's value,
a finer one by factors of 2^(1/4) around the best, all on one failure trace (common random numbers, so the
comparison between intervals is not drowned by the draw), then a least-squares fit of the waste model
1 - goodput = a + b / (T + C) + c * (T + C) to the points within a factor 4 of the best (`fit_waste`), whose
minimum is the recommendation: the fit averages out the noise of any single interval's failures.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from reve_jax.tools.plan.cluster import RECOVERY_MECHANISMS, ClusterConfig, Trace, draw_trace, with_mechanisms
from reve_jax.tools.plan.sim import SimResult, simulate

# The combinations compare_mechanisms also simulates: the relaunch path with everything, then in-process on top.
MECHANISM_SETS = [["fast_restart", "snapshots"], ["fast_restart", "snapshots", "in_process"]]


def young_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints, sqrt(2 C M), in seconds."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds); M itself when the checkpoint costs 2M or more."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return young_s(cost_s, mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


@dataclasses.dataclass
class Recommendation:
    points: list[tuple[float, float]]  # (interval s, goodput) for every simulated interval, by interval
    best_s: float  # the simulated interval with the highest goodput
    fit_s: float  # the minimum of the fitted waste model: the recommendation
    young_s: float
    daly_s: float
    mtbf_s: float  # of the hosts the job trains on
    cost_s: float  # the blocking cost of one checkpoint
    step_s: float
    runtime_s: float

    @property
    def fit_steps(self) -> int:
        return max(1, round(self.fit_s / self.step_s))


def sweep(c: ClusterConfig, policy: str, intervals_s, trace: Trace | None = None) -> list[tuple[float, float]]:
    """Goodput of `policy` at each checkpoint interval (seconds of compute, rounded to whole steps), all on
    the trace of `c` (or `trace`). Returns (interval s, goodput) pairs sorted by interval, duplicates merged."""
    trace = trace if trace is not None else draw_trace(c)
    out: dict[float, float] = {}
    for t in intervals_s:
        steps = max(1, round(t / c.step_s))
        actual = steps * c.step_s
        if actual not in out:
            out[actual] = simulate(dataclasses.replace(c, ckpt_interval_s=actual), policy, trace).goodput
    return sorted(out.items())


def fit_waste(points: list[tuple[float, float]], cost_s: float) -> float | None:
    """The interval T minimising the waste model fitted to `points` (least squares, in x = T + C, the length of
    one compute-and-save cycle): 1 - goodput = a + b / x + c * x, where b / x is the share of time spent saving
    and c * x the work lost per failure (half a cycle) times the failure rate. Returns sqrt(b / c) - C, or None
    if the fit has no interior minimum (b or c not positive)."""
    x = np.array([p[0] for p in points]) + cost_s
    w = 1.0 - np.array([p[1] for p in points])
    coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(x), 1.0 / x, x], axis=1), w, rcond=None)
    _, b, c = coef
    return math.sqrt(b / c) - cost_s if b > 0 and c > 0 else None


def recommend(c: ClusterConfig, policy: str = "isolate", trace: Trace | None = None) -> Recommendation:
    """Sweeps and refines the checkpoint interval of `c` under `policy`; returns the Recommendation."""
    wall0 = time.perf_counter()
    trace = trace if trace is not None else draw_trace(c)
    mtbf = c.job_mtbf_s()
    if not math.isfinite(mtbf):
        raise ValueError("no failures (failures_per_gpu_day=0): any interval longer than the run is best")
    guess = young_s(c.ckpt_save_s, mtbf)
    points = sweep(c, policy, [guess * 2.0**k for k in range(-3, 4)], trace)
    best = max(points, key=lambda p: p[1])[0]
    fine = [best * 2.0 ** (j / 4) for j in (-3, -2, -1, 1, 2, 3)]
    points = sorted(dict(points + sweep(c, policy, fine, trace)).items())
    best = max(points, key=lambda p: p[1])[0]
    near = [p for p in points if best / 4.01 <= p[0] <= best * 4.01]
    fit = fit_waste(near, c.ckpt_save_s)
    lo, hi = near[0][0], near[-1][0]
    fit = best if fit is None else min(max(fit, lo), hi)
    return Recommendation(
        points=points,
        best_s=best,
        fit_s=fit,
        young_s=guess,
        daly_s=daly_s(c.ckpt_save_s, mtbf),
        mtbf_s=mtbf,
        cost_s=c.ckpt_save_s,
        step_s=c.step_s,
        runtime_s=time.perf_counter() - wall0,
    )


def compare_mechanisms(c: ClusterConfig, policy: str = "isolate") -> dict[str, SimResult]:
    """`c` as given ("before"), with each recovery mechanism alone, and with the combinations of MECHANISM_SETS,
    all on one failure trace. Returns name -> result."""
    trace = draw_trace(c)
    out = {"before": simulate(c, policy, trace)}
    for names in [[n] for n in RECOVERY_MECHANISMS] + MECHANISM_SETS:
        out["+ " + " + ".join(names)] = simulate(with_mechanisms(c, names), policy, trace)
    return out


def compare_policies(c: ClusterConfig, spares: int = 0) -> dict[str, SimResult]:
    """isolate-and-continue and restart-all on one failure trace (same seed), without spares (and isolate with
    re-admission at once when `c` re-admits by cost), and with `spares` extra hosts if > 0 (the first `c.hosts`
    hosts fail identically in both). Returns name -> result."""
    base = dataclasses.replace(c, spares=0)
    trace = draw_trace(base)
    out = {
        "isolate": simulate(base, "isolate", trace),
        "restart-all": simulate(base, "restart-all", trace),
    }
    if c.readmit_rule == "cost":  # what the cost rule saves over stopping for every repaired host
        out["isolate, re-admit always"] = simulate(dataclasses.replace(base, readmit_rule="always"), "isolate", trace)
    if spares > 0:
        extra = dataclasses.replace(c, spares=spares)
        trace = draw_trace(extra)
        out[f"isolate, {spares} spares"] = simulate(extra, "isolate", trace)
        out[f"restart-all, {spares} spares"] = simulate(extra, "restart-all", trace)
    return out

"""Plain-text reports of simulations, policy comparisons and checkpoint-interval recommendations."""

from __future__ import annotations

import dataclasses

from reve_jax.tools.plan.cluster import ClusterConfig
from reve_jax.tools.plan.interval import Recommendation, daly_s, young_s
from reve_jax.tools.plan.sim import MECHANISMS, SimResult

# What each mechanism of the accounting means, for the reports.
MEANING = {
    "checkpoint": "blocking checkpoint saves (and the save of each clean stop)",
    "snapshot": "training time the in-memory snapshots block",
    "rework": "work done after the last checkpoint, lost on a failure",
    "detection": "fault -> the policy kills the group (exit window, heartbeat, hang timeouts)",
    "restart": "kill -> every new process connected",
    "restore": "reading the checkpoint",
    "startup": "compile and first step",
    "slow": "a straggler slowing every step until it is drained",
    "hosts_out": "hosts outside the training group (broken, quarantined, excluded, spare)",
    "waiting": "whole job waiting for hosts (fewer usable than min_hosts)",
    "stopped": "the policy gave up (too few hosts left)",
}


def describe_cluster(c: ClusterConfig) -> str:
    """Two lines: the cluster and its failure model, the checkpoint cost with Young's and Daly's intervals."""
    mtbf = c.job_mtbf_s()
    fails = f"{c.failures_per_gpu_day:.3g} failures per GPU-day (job MTBF {mtbf / 3600:.2f} h)"
    mix = ", ".join(f"{k} {v:g}" for k, v in zip(("crash", "lost", "hang", "slow"), c.mix, strict=True))
    line1 = (
        f"{c.days:g} days, {c.hosts:,} hosts x {c.gpus_per_host} GPUs ({c.hosts * c.gpus_per_host:,} GPUs) + "
        f"{c.spares} spares, seed {c.seed}; {fails}; mix {mix}; repair median {c.repair_median_h:g} h"
    )
    line2 = (
        f"checkpoint every {c.ckpt_every} steps ({c.ckpt_every * c.step_s:g} s of compute at {c.step_s:g} s/step), "
        f"a save blocks {c.ckpt_save_s:g} s"
    )
    if mtbf != float("inf"):
        line2 += f"; Young {young_s(c.ckpt_save_s, mtbf):.0f} s, Daly {daly_s(c.ckpt_save_s, mtbf):.0f} s"
    return line1 + "\n" + line2


def format_result(r: SimResult) -> str:
    """The report of one simulation: goodput, GPU time lost by mechanism and by cause, hosts out, counts."""
    c = r.config
    total = sum(r.gpu_hours.values())
    job = c.hosts * c.gpus_per_host * c.horizon_s / 3600.0
    lines = [f"policy {r.policy}: {describe_cluster(c)}"]
    head = f"goodput {100 * r.goodput:.2f}% of all GPU time"
    if c.spares:
        head += f" ({100 * r.gpu_hours['productive'] / job:.2f}% of the job's {c.hosts * c.gpus_per_host:,} GPUs)"
    lines.append(f"{head}; {r.kept_steps:,} steps kept" + (f"; FINISHED EARLY: {r.finish}" if r.finish else ""))
    lines.append(f"  {'lost to':<12} {'GPU-hours':>12} {'share':>7}")
    for m in MECHANISMS[1:]:
        h = r.gpu_hours[m]
        if h > 0:
            lines.append(f"  {m:<12} {h:>12,.0f} {100 * h / total:>6.2f}%  {MEANING[m]}")
    causes = ", ".join(f"{k} {v:,.0f}" for k, v in r.lost_by_cause.items() if v >= 0.5)
    lines.append(f"  by cause (GPU-h, hosts out excluded; 'none' = periodic saves): {causes}")
    hits = ", ".join(f"{k} {r.hits.get(k, 0)}/{v}" for k, v in sorted(r.faults.items()))
    lines.append(f"faults that struck the job / all faults: {hits or 'none'}")
    rec = r.records
    lines.append(
        f"policy: {rec.get('failure', 0)} failures, {rec.get('quarantine', 0)} quarantines, "
        f"{rec.get('exclude', 0)} exclusions, {rec.get('readmit', 0)} re-admissions, "
        f"{rec.get('launch', 0)} launches; mean recovery (fault -> first step of the new group): "
        + (", ".join(f"{k} {v:.0f} s" for k, v in r.recovery_s.items()) or "none")
    )
    if r.detection_s:
        det = "; ".join(f"{k}: {v:.0f} s" for k, v in r.detection_s.items())
        lines.append(f"mean detection by the policy's reason: {det}")
    lines.append(
        f"hosts broken at once: max {r.hosts_down[0]}, mean {r.hosts_down[1]:.2f}; outside the training group: "
        f"max {r.hosts_out[0]}, mean {r.hosts_out[1]:.2f}"
    )
    if r.restores:
        lines.append("restores: " + ", ".join(f"{v} from {k}" for k, v in sorted(r.restores.items())))
    lines.append(f"simulated in {r.runtime_s:.1f} s ({r.policy_steps:,} policy steps)")
    return "\n".join(lines)


def format_comparison(results: dict[str, SimResult]) -> str:
    """One row per policy: goodput and the share of GPU time lost to each mechanism (percent)."""
    shown = [m for m in MECHANISMS[1:] if any(r.gpu_hours[m] > 0 for r in results.values())]
    w = max(28, *(len(name) for name in results))
    head = f"{'policy':<{w}} {'goodput':>8} {'steps kept':>11} " + " ".join(f"{m[:10]:>10}" for m in shown)
    lines = [head]
    for name, r in results.items():
        total = sum(r.gpu_hours.values())
        cells = " ".join(f"{100 * r.gpu_hours[m] / total:>9.2f}%" for m in shown)
        lines.append(f"{name:<{w}} {100 * r.goodput:>7.2f}% {r.kept_steps:>11,} {cells}")
    base = results.get("restart-all")
    iso = results.get("isolate")
    if base is not None and iso is not None and base.kept_steps:
        gain = iso.kept_steps / base.kept_steps - 1
        lines.append(f"isolate-and-continue keeps {100 * gain:+.1f}% steps over restart-all on the same trace")
    return "\n".join(lines)


def format_mechanisms(results: dict[str, SimResult]) -> str:
    """What each run of a before/after comparison changed: the fields that differ from "before", its mean
    recovery and its restores."""
    before = results["before"].config
    lines = []
    for name, r in results.items():
        changed = {
            f.name: getattr(r.config, f.name)
            for f in dataclasses.fields(r.config)
            if getattr(r.config, f.name) != getattr(before, f.name)
        }
        what = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items())
        rec = ", ".join(f"{k} {v:.0f} s" for k, v in r.recovery_s.items()) or "none"
        restores = ", ".join(f"{v} from {k}" for k, v in sorted(r.restores.items()))
        lines.append(f"{name}: {what or 'the defaults'}; mean recovery {rec}; restores {restores}")
    return "\n".join(lines)


def format_recommendation(rec: Recommendation) -> str:
    """The sweep's table and the recommended interval beside Young's and Daly's."""
    lines = [f"{'interval (s)':>12} {'steps':>7} {'goodput':>8}"]
    for t, g in rec.points:
        mark = "  <- best simulated" if t == rec.best_s else ""
        lines.append(f"{t:>12,.0f} {round(t / rec.step_s):>7,} {100 * g:>7.3f}%{mark}")
    lines.append(
        f"recommended: checkpoint every {rec.fit_steps:,} steps ({rec.fit_s:,.0f} s of compute; fitted optimum of "
        f"the waste model), vs Young sqrt(2*C*M) = {rec.young_s:,.0f} s ({100 * (rec.fit_s / rec.young_s - 1):+.1f}%)"
        f" and Daly {rec.daly_s:,.0f} s, for C = {rec.cost_s:g} s and M = {rec.mtbf_s / 3600:.2f} h; "
        f"{len(rec.points)} simulations in {rec.runtime_s:.0f} s"
    )
    return "\n".join(lines)


def to_json(r: SimResult) -> dict:
    """A SimResult as a JSON-ready dict."""
    return dataclasses.asdict(r)

"""The speedup benchmark's outputs: results.json, a markdown report (speedup.md) and a plot of quality against
wall clock (executed FLOPs where runs were reused) and against steps (speedup.png, matplotlib with the Agg
backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from reve_jax.speedup import analysis

LABELS = {
    "latent": "baseline A: latent DiT (v-pred, autoencoder)",
    "pixel": "baseline B: pixel DiT (v-pred, 48 values/token)",
    "pixel_p8": "control: pixel DiT (v-pred, 192 values/token)",
    "recipe": "JIT-DDT recipe",
    "prx": "PRX variant (recipe + TREAD + Muon)",
}
COST_NAMES = {"step": "steps", "samples": "samples", "flops": "TFLOP", "wall_s": "wall s", "cpu_s": "CPU s"}


def label(method: str) -> str:
    if method in LABELS:
        return LABELS[method]
    for base, name in (("recipe-", "recipe"), ("prx-", "PRX")):
        if method.startswith(base):
            return f"{name} without {method.removeprefix(base)}"
    return method


def _order(methods, baseline: str) -> list[str]:
    methods = list(dict.fromkeys(methods))
    return [baseline] * (baseline in methods) + [m for m in methods if m != baseline]


def machines_line(runs: list[dict]) -> str:
    """Which CPUs the runs trained on (from each run's `machine_start`): wall and CPU seconds compare only runs of
    one machine, and a benchmark that reuses runs can mix them."""
    counts: dict[str, int] = {}
    for r in runs:
        m = r.get("machine_start") or {}
        devices = ", ".join(m.get("devices") or ["?"])
        name = f"{m.get('cpu') or 'CPU model not recorded'}, {m.get('cpus', '?')} CPUs, {devices}"
        counts[name] = counts.get(name, 0) + 1
    line = "Trained on: " + "; ".join(f"{k} ({n} run{'s' * (n != 1)})" for k, n in counts.items()) + "."
    if len(counts) > 1:
        line += " **The runs trained on different machines: compare steps, samples and FLOPs, not wall or CPU "
        line += "seconds.**"
    return line


def interval_text(center: float, lo: float, hi: float, kind: str, fmt: str = "{:.2f}", unit: str = "") -> str:
    """'2.10x [1.85x, 2.40x]' for a 95% interval, '2.10x (range 1.85x-2.40x)' for the range of fewer seeds."""
    if not math.isfinite(center):
        return "-"

    def f(v):
        return fmt.format(v) + unit

    if lo == hi:
        return f(center)
    return f"{f(center)} [{f(lo)}, {f(hi)}]" if kind == "ci" else f"{f(center)} (range {f(lo)}-{f(hi)})"


SPEEDUP_COSTS = ("step", "flops", "wall_s", "cpu_s")


def speedup_cell(row: dict, cost: str) -> str:
    """A method's speedup on `cost` (an analysis row: "speedup", "interval", "upper_bound", "reached"), "<=" when
    censored; a method that reached the target on no seed has no speedup, only the bound: "never (<=...)"."""
    text = "<=" * row["upper_bound"] + interval_text(*row["speedup"][cost], row["interval"], unit="x")
    return f"never ({text})" if row.get("reached") == 0 and text != "-" else text


def markdown_table(results: dict) -> str:
    """The per-seed gate, the time to the baseline's plateau (speedups with their interval or range), the per-seed
    speedups in steps, the finals and the per-attribute alignment."""
    size, summary = results["size"], results["summary"]
    baseline = size["baseline"]
    tt = summary["time_to_target"]
    lines = [f"Size `{size['name']}`: {size['steps']} steps per run, seeds {list(size['seeds'])}, evaluated every "
             f"{max(1, size['steps'] // size['evals'])} steps on {size['n_eval']} captions of the "
             f"{results.get('split', 'unseen')} compositions. Target: each seed's baseline plateau (mean of its last "
             f"{analysis.PLATEAU} evaluations) of {tt['metric']}; every method, the baseline too, is timed by the "
             "first crossing held for two evaluations; a run that never reaches it (or diverges) is censored at the "
             "full budget (<=). Intervals: 95% bootstrap over seeds and, within each evaluation, captions, from "
             f"{analysis.CI_SEEDS} seeds; with fewer, the range of the per-seed values.", ""]  # fmt: skip
    lines += [machines_line(results.get("runs", [])), ""]
    for g in tt["gate"]:
        lines.append(f"- seed {g['seed']}: gate {'passed' if g['ok'] else '**failed**'}: {g['why']}")
    lines += ["", ("" if tt["ok"] else "**") + tt["why"] + ("" if tt["ok"] else "**"), ""]
    rows = tt["methods"]
    reused = reused_runs(results)
    costs = SPEEDUP_COSTS if not reused else ("step", "flops")
    if tt["ok"] and rows:
        if reused:
            lines += [f"{reused} runs were reused from an earlier invocation: compared in steps and FLOPs only (wall "
                      "and CPU seconds compare runs of one invocation on one machine).", ""]  # fmt: skip
        lines += ["| method | seeds reaching | " + " | ".join(f"speedup {COST_NAMES[k]}" for k in costs)
                  + " |", "|---" * (2 + len(costs)) + "|"]  # fmt: skip
        for m in _order(rows, baseline):
            r = rows[m]
            cells = [speedup_cell(r, k) for k in costs]
            lines.append(f"| {label(m)} | {r['reached']}/{r['seeds']} | " + " | ".join(cells) + " |")
        lines += one_time_lines(results, rows, baseline, reused)
        seeds = [p["seed"] for p in rows[baseline]["per_seed"]] if baseline in rows else []
        lines += [
            "",
            "Per seed, the speedup in steps (`<=`: the target not reached, censored at the full budget):",
            "",
            "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
            "|---" * (1 + len(seeds)) + "|",
        ]
        for m in _order(rows, baseline):
            by = {p["seed"]: p for p in rows[m]["per_seed"]}
            cells = [("<=" * (not by[s]["reached"]) + f"{by[s]['speedup']['step']:.2f}x") if s in by else "-"
                     for s in seeds]  # fmt: skip
            lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += factor_lines(tt.get("factors", []), costs)
    finals = summary["finals"]
    cols = [c for c in ("align_exact", "align_overall", "kid", "vloss") if any(c in f for f in finals.values())]
    if cols:
        lines += [f"Final values (each seed's mean of its last {analysis.PLATEAU} evaluations; mean over seeds):", "",
                  "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]  # fmt: skip
        for m in _order(finals, baseline):
            f = finals[m]
            cells = [interval_text(f[c]["mean"], f[c]["lo"], f[c]["hi"], f[c]["interval"], "{:.4f}") if c in f else "-"
                     for c in cols]  # fmt: skip
            lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + attribute_table(results)


BOUND_MARK = {None: "", "upper": "<=", "lower": ">=", "none": "?"}


def factor_lines(factors: list[dict], costs) -> list[str]:
    """The 2x2 read as factors: each the ratio of two cells' times to baseline A's plateau ("<=" where the faster
    cell is censored on a seed, ">=" where the slower one is, "?" where both are or the seeds disagree), with its
    interval or range and the per-seed values in steps."""
    if not factors:
        return []
    lines = ["Which factor carries the speedup: per seed, the slower cell's cost to baseline A's plateau over the "
             "faster cell's (`<=`: the faster cell censored, `>=`: the slower one, `?`: no bound either way):", "",
             "| factor | cells | seeds | " + " | ".join(COST_NAMES[k] for k in costs) + " | per seed (steps) |",
             "|---" * (4 + len(costs)) + "|"]  # fmt: skip
    for f in factors:
        mark = BOUND_MARK[f["bound"]]
        cells = [mark + interval_text(*f["ratio"][k], f["interval"], unit="x") for k in costs]
        seeds = ", ".join(f"{p['seed']}: {BOUND_MARK[p['bound']]}{p['ratio']['step']:.2f}x" for p in f["per_seed"])
        lines.append(f"| {f['name']} | {f['fast']} over {f['slow']} | {f['seeds']} | " + " | ".join(cells)
                     + f" | {seeds} |")  # fmt: skip
    return [*lines, ""]


AMORTIZED = {"flops": ("flops", "executed FLOPs"), "wall_s": ("seconds", "wall clock")}  # run cost: one-time key


def one_time_lines(results: dict, rows: dict, baseline: str, reused: int) -> list[str]:
    """The one-time costs (the autoencoder's, REPA's target network's training) in their own table, and the
    speedup with them amortized over the headline's runs of each method that needs them: in executed FLOPs, and in
    wall clock when no run was reused (reused runs compare in steps and FLOPs only). A method's ratio is an upper
    bound (`<=`) where it did not reach the target on a seed."""
    costs = {k: v for k, v in results.get("one_time", {}).items() if v.get("seconds") or v.get("flops")}
    if not costs:
        return []
    lines = ["", "One-time costs (training once, shared by every run of the methods that use it):", "",
             "| what | seconds | TFLOP | methods |", "|---|---|---|---|"]  # fmt: skip
    for k, v in costs.items():
        secs, flops = v.get("seconds"), v.get("flops")
        cells = [f"{secs:.0f}" if secs else "not recorded", f"{flops * 1e-12:.1f}" if flops else "not recorded"]
        lines.append(f"| {k} | {' | '.join(cells)} | {', '.join(v['methods'])} |")
    if baseline not in rows:
        return lines
    n_runs = {m: rows[m]["seeds"] for m in rows}
    for cost in ("flops",) + (() if reused else ("wall_s",)):
        key, name = AMORTIZED[cost]
        if any(not v.get(key) for v in costs.values()):
            lines += ["", f"No speedup in {name} with the one-time costs amortized: a one-time cost's {name} was "
                      "not recorded."]  # fmt: skip
            continue

        def extra(m, key=key):  # a method's share of the one-time costs per run
            return sum(v[key] / sum(n_runs.get(u, 0) for u in v["methods"]) for v in costs.values()
                       if m in v["methods"])  # fmt: skip

        base = {p["seed"]: p["cost"][cost] + extra(baseline) for p in rows[baseline]["per_seed"]}
        lines += ["", f"Speedup in {name} with the one-time costs amortized over the headline's runs (`<=`: the "
                  "target not reached on a seed, censored at the full budget):", ""]  # fmt: skip
        for m in _order(rows, baseline):
            per = [(base[p["seed"]] / (p["cost"][cost] + extra(m)), p["reached"]) for p in rows[m]["per_seed"]
                   if p["seed"] in base]  # fmt: skip
            mean = float(np.exp(np.mean(np.log([r for r, _ in per]))))
            lines.append(f"- {label(m)}: {'' if all(ok for _, ok in per) else '<='}{mean:.2f}x (per seed "
                         + ", ".join(f"{'' if ok else '<='}{r:.2f}x" for r, ok in per) + ")")  # fmt: skip
    return lines


def attribute_table(results: dict) -> str:
    """Final per-attribute caption alignment per method (mean over seeds), markdown; "" without runs."""
    from reve_jax.data.synthetic.alignment import ATTRIBUTES

    runs = [r for r in results.get("runs", []) if r["curve"]]
    if not runs:
        return ""
    lines = ["", "Final caption alignment per attribute (mean over seeds):", ""]
    lines.append("| method | " + " | ".join(ATTRIBUTES) + " | all checks of an image |")
    lines.append("|---" * (len(ATTRIBUTES) + 2) + "|")
    for m in _order([r["method"] for r in runs], results["size"]["baseline"]):
        last = [r["curve"][-1] for r in runs if r["method"] == m]
        vals = [np.mean([f.get(f"align_{a}", np.nan) for f in last]) for a in (*ATTRIBUTES, "exact")]
        lines.append(f"| {label(m)} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def _mean_curve(runs: list[dict], key: str, metric: str):
    steps = sorted({p["step"] for r in runs for p in r["curve"]})
    xs, ys = [], []
    for s in steps:
        pts = [p for r in runs for p in r["curve"] if p["step"] == s and metric in p]
        if len(pts) == len(runs):  # only where every seed has a point (a diverged run ends early)
            xs.append(np.mean([p[key] for p in pts]))
            ys.append(np.mean([p[metric] for p in pts]))
    return xs, ys


def kid_scale(values) -> tuple:
    """The y scale of a KID plot: log while every value is positive, else symlog, linear within 1e-3 of 0 (the
    unbiased estimator goes below 0 near the floor); a symlog axis of positive values wastes half the plot on
    negatives."""
    return ("log", {}) if min(values, default=1.0) > 0 else ("symlog", {"linthresh": 1e-3})


X_AXES = {  # a cost: its axis label and scale
    "wall_s": ("training wall clock (s)", 1.0),
    "flops": ("executed TFLOP", 1e-12),
    "step": ("training steps", 1.0),
}


def reused_runs(results: dict) -> int:
    """How many runs came from an earlier invocation: with any, wall and CPU seconds compare nothing (the table
    and the plot show steps and FLOPs)."""
    return sum(bool(r.get("reused")) for r in results.get("runs", []))


def x_axes(results: dict) -> tuple[str, str]:
    """The plot's two x axes: wall clock and steps; executed FLOPs and steps when any run was reused."""
    return ("flops" if reused_runs(results) else "wall_s", "step")


def plot(results: dict, path: str | Path, metrics=("align_overall", "kid")) -> Path:
    """Quality (rows: `metrics`) against training wall clock (executed FLOPs where runs were reused, `x_axes`) and
    against steps (columns); per method the mean over seeds in bold and each seed thin; the baseline's final (mean
    over seeds) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["curve"]]
    metrics = [m for m in metrics if runs and all(m in r["curve"][-1] for r in runs)]
    baseline = results["size"]["baseline"]
    methods = _order([r["method"] for r in runs], baseline)
    fig, axes = plt.subplots(max(1, len(metrics)), 2, figsize=(12, 4.2 * max(1, len(metrics))), squeeze=False)
    colors = plt.get_cmap("tab10")
    for row, metric in enumerate(metrics):
        for col, key in enumerate(x_axes(results)):
            ax = axes[row][col]
            name, x_scale = X_AXES[key]
            for i, m in enumerate(methods):
                rs = [r for r in runs if r["method"] == m]
                for r in rs:
                    pts = [p for p in r["curve"] if metric in p]
                    ax.plot([p[key] * x_scale for p in pts], [p[metric] for p in pts], color=colors(i), alpha=0.3,
                            lw=0.8)  # fmt: skip
                xs, ys = _mean_curve(rs, key, metric)
                ax.plot(np.asarray(xs) * x_scale, ys, color=colors(i), lw=2, marker="o", ms=3, label=label(m))
            base = [analysis.plateau([p[metric] for p in r["curve"]]) for r in runs if r["method"] == baseline]
            if base:
                ax.axhline(float(np.mean(base)), color="k", ls="--", lw=1, label="baseline plateau (target)")
            ax.set_xlabel(name)
            ax.set_ylabel(metric)
            if metric == "kid":
                scale, kw = kid_scale([p[metric] for r in runs for p in r["curve"] if metric in p])
                ax.set_yscale(scale, **kw)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"speedup benchmark, size {results['size']['name']}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(results: dict, out_dir: str | Path) -> None:
    """results.json, speedup.md and speedup.png in `out_dir` (rewritten as results come in)."""
    out = Path(out_dir)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "speedup.md").write_text(markdown_table(results))
    if any(r["curve"] for r in results["runs"]):
        plot(results, out / "speedup.png")

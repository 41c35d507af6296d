"""The speedup benchmark's outputs: results.json, a markdown table (speedup.md) and a plot of quality against
wall clock and against steps (speedup.png, matplotlib with the Agg backend)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

LABELS = {"baseline": "baseline (DiT)", "recipe": "full recipe"}


def label(method: str) -> str:
    return LABELS.get(method, f"baseline + {method}")


def _pm(v, fmt: str = "{:.0f}", scale: float = 1.0) -> str:
    """(mean, std) -> 'mean ± std'; None -> 'not reached'."""
    if v is None:
        return "not reached"
    m, s = v
    return f"{fmt.format(m * scale)} ± {fmt.format(s * scale)}" if s else fmt.format(m * scale)


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None and math.isfinite(v) else "-"


def _order(summary: dict) -> list[str]:
    first = [m for m in ("baseline", "recipe") if m in summary]
    return first + sorted(m for m in summary if m not in first)


def baseline_gain(results: dict, metric: str, higher_is_better: bool) -> float | None:
    """How far the chosen baseline runs moved on `metric` from their first to their final evaluation (mean over
    seeds), positive when they got better; None without baseline runs."""
    base = [r for r in results.get("runs", {}).values() if r["method"] == "baseline" and r.get("chosen")]
    base = [r["curve"] for r in base if r["curve"] and metric in r["curve"][0]]
    if not base:
        return None
    gain = float(np.mean([c[-1][metric] - c[0][metric] for c in base]))
    return gain if higher_is_better else -gain


def _floor_warning(results: dict, metric: str, name: str, higher_is_better: bool) -> str:
    gain = baseline_gain(results, metric, higher_is_better)
    if gain is None or gain > 0:
        return ""
    return (
        f"**The baseline did not improve on {name} during its budget** (final no better than its first "
        "evaluation): the target is its starting level, so reaching it means nothing and every time to target "
        "for this metric is meaningless. Compare the final columns instead (quality at the same budget).\n\n"
    )


def markdown_table(results: dict) -> str:
    """The primary table (caption alignment) and a secondary one (FD-shapes and v-loss targets), markdown."""
    primary = results["summary"].get("align_overall", {})
    target = results["targets"].get("align_overall")
    head = (
        "| method | seeds reaching target | steps to target | samples | executed TFLOP | train wall s | "
        "train CPU s | speedup steps | speedup wall | final align | final exact | final FD-shapes | final v-loss | "
        "s/step |\n" + "|---" * 14 + "|\n"
    )
    lines = []
    for m in _order(primary):
        r = primary[m]
        lines.append(
            f"| {label(m)} | {r['reached']}/{r['seeds']} | {_pm(r['step'])} | {_pm(r['samples'])} | "
            f"{_pm(r['flops'], '{:.1f}', 1e-12)} | {_pm(r['wall_s'], '{:.0f}')} | {_pm(r['cpu_s'], '{:.0f}')} | "
            f"{_x(r['speedup_step'])} | {_x(r['speedup_wall_s'])} | {_pm(r['final_align_overall'], '{:.3f}')} | "
            f"{_pm(r['final_align_exact'], '{:.3f}')} | {_pm(r['final_fd_shapes'], '{:.1f}')} | "
            f"{_pm(r['final_vloss'], '{:.4f}')} | {r['s_per_step'] or float('nan'):.3f} |"
        )
    tgt = f"{target:.3f}" if target is not None else "-"
    out = f"Target: the baseline's final caption alignment, {tgt} (mean over its seeds).\n\n"
    out += _floor_warning(results, "align_overall", "caption alignment", True) + head + "\n".join(lines)
    sec = ["| method | steps to baseline's final FD-shapes | speedup | steps to baseline's final v-loss | speedup |"]
    sec.append("|---|---|---|---|---|")
    fd, vl = results["summary"].get("fd_shapes", {}), results["summary"].get("vloss", {})
    for m in _order(fd):
        a, b = fd[m], vl.get(m, {"step": None, "speedup_step": None, "reached": 0, "seeds": 0})
        sec.append(
            f"| {label(m)} | {_pm(a['step'])} ({a['reached']}/{a['seeds']}) | {_x(a['speedup_step'])} | "
            f"{_pm(b['step'])} ({b['reached']}/{b['seeds']}) | {_x(b['speedup_step'])} |"
        )
    t = results["targets"]
    note = (
        f"\n\nTargets: FD-shapes {t.get('fd_shapes', float('nan')):.2f}, v-loss {t.get('vloss', float('nan')):.4f} "
        "(baseline finals, mean over seeds).\n\n"
    )
    note += _floor_warning(results, "fd_shapes", "FD-shapes", False) + _floor_warning(results, "vloss", "v-loss", False)
    return out + note + "\n".join(sec) + "\n" + attribute_table(results)


def attribute_table(results: dict) -> str:
    """Final per-attribute caption alignment per method (mean over the chosen seeds), markdown; "" without runs."""
    from reve_jax.eval.alignment import ATTRIBUTES

    runs = [r for r in results.get("runs", {}).values() if r.get("chosen") and r["curve"]]
    if not runs:
        return ""
    lines = ["", "Final caption alignment per attribute (mean over seeds):", ""]
    lines.append("| method | " + " | ".join(ATTRIBUTES) + " | all checks of an image |")
    lines.append("|---" * (len(ATTRIBUTES) + 2) + "|")
    for m in _order({r["method"]: None for r in runs}):
        finals = [r["curve"][-1] for r in runs if r["method"] == m]
        vals = [np.mean([f.get(f"align_{a}", np.nan) for f in finals]) for a in (*ATTRIBUTES, "exact")]
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


def plot(results: dict, path: str | Path, metrics=("align_overall", "fd_shapes")) -> Path:
    """Quality (rows: `metrics`) against training wall clock and against steps (columns); per method the mean
    over seeds in bold and each seed thin; the baseline's target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in results["runs"].values() if r.get("chosen") and r["curve"]]
    methods = _order({r["method"]: None for r in chosen})
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 4.2 * len(metrics)), squeeze=False)
    colors = plt.get_cmap("tab10")
    for row, metric in enumerate(metrics):
        for col, key in enumerate(("wall_s", "step")):
            ax = axes[row][col]
            for i, m in enumerate(methods):
                rs = [r for r in chosen if r["method"] == m]
                for r in rs:
                    pts = [p for p in r["curve"] if metric in p]
                    ax.plot([p[key] for p in pts], [p[metric] for p in pts], color=colors(i), alpha=0.3, lw=0.8)
                xs, ys = _mean_curve(rs, key, metric)
                ax.plot(xs, ys, color=colors(i), lw=2, marker="o", ms=3, label=label(m))
            target = results["targets"].get(metric)
            if target is not None and math.isfinite(target):
                ax.axhline(target, color="k", ls="--", lw=1, label="target (baseline final)")
            ax.set_xlabel("training wall clock (s)" if key == "wall_s" else "training steps")
            ax.set_ylabel(metric)
            if metric.startswith("fd"):
                ax.set_yscale("log")
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
    if any(r.get("chosen") and r["curve"] for r in results["runs"].values()):
        plot(results, out / "speedup.png")

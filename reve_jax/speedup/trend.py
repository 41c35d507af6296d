"""The trend with resolution (issue 45, item 8): the same protocol's headline at several image sizes, one row per
size and method, and one plot of each method's speedup over the baseline against the resolution, with intervals.

    python scripts/bench_speedup.py --trend runs/speedup_cpu30 runs/speedup_cpu30f runs/speedup_cpu64

A size's rendering (data.render) is part of its point: the plot draws one line per method and rendering, so that a
control at the same resolution in another rendering (cpu30f beside cpu30) is a point of its own, not a step of the
line.

Reads each finished benchmark's results.json (run_benchmark's), writes trend.md, trend.json and trend.png. Every size
must time its methods against the same baseline by the same rule, so that the ratios are of one kind; a size whose
baseline fails the gate on too many seeds enters the table as "no speedup measurable" and leaves the plot. The
plot's costs are steps and executed FLOPs (sizes run on different machines and days compare in those); wall clock
is in the table where a size's runs were of one invocation (report.py's rule)."""

from __future__ import annotations

import json
from pathlib import Path

from reve_jax import config as config_lib
from reve_jax.speedup import report

COSTS = ("step", "flops")
RENDER_NAMES = {"jitter": "jittered", "fixed": "fixed"}
YTICKS = (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class TrendError(ValueError):
    """The results given cannot be put on one trend (say which and why)."""


def load(out_dir) -> dict:
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        raise TrendError(f"{path} not found: --trend takes the --out directories of finished benchmarks")
    return json.loads(path.read_text())


def _config_values(results: dict, key: str, default) -> set:
    """The values of data.<key> over a benchmark's runs (from the runs' configs)."""
    values = set()
    for r in results.get("runs", []):
        cfg = r["config"]
        cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
        values.add(cfg["data"].get(key, default))
    return values


def resolution(results: dict) -> int:
    """The image size (px) every run of a benchmark trained at, from the runs' configs."""
    sizes = _config_values(results, "image_size", None)
    if len(sizes) != 1 or None in sizes:
        name = results.get("size", {}).get("name", "?")
        known = sorted(v for v in sizes if v is not None)
        without = " and runs without one" if None in sizes else ""
        raise TrendError(f"size {name}: runs at image sizes {known or 'none'}{without}; a trend point needs one")
    return int(sizes.pop())


def rendering(results: dict) -> str:
    """The rendering (data.render: 'fixed' or 'jitter') every run of a benchmark trained on. Points in different
    renderings are different curves: the trend with resolution is read along one rendering."""
    renders = _config_values(results, "render", config_lib.ADDED_KEYS["data.render"])  # before the key: fixed
    if len(renders) != 1:
        name = results.get("size", {}).get("name", "?")
        raise TrendError(f"size {name}: runs in the renderings {sorted(renders)}; a trend point needs one")
    return renders.pop()


def rows(all_results: list[dict]) -> list[dict]:
    """One row per (size, method other than the baseline), sorted by resolution, then rendering: {"size",
    "resolution", "render", "method", "ok", "why", "seeds", "reached", "interval", "upper_bound", "speedup": {cost:
    (center, lo, hi)}, "wall"}."""
    baselines = {r["size"]["baseline"] for r in all_results}
    if len(baselines) != 1:
        raise TrendError(
            f"the sizes time their methods against different baselines {sorted(baselines)}: a trend compares "
            "ratios over one baseline (pass --baseline alike to every size's benchmark)"
        )
    out = []
    for px, render, res in sorted(((resolution(r), rendering(r), r) for r in all_results), key=lambda t: t[:2]):
        tt = res["summary"]["time_to_target"]
        base = res["size"]["baseline"]
        methods = [m for m in res["methods"] if m != base]
        reused = any(r.get("reused") for r in res["runs"])
        for m in methods:
            row = {"size": res["size"]["name"], "resolution": px, "render": render, "method": m, "ok": False,
                   "why": tt["why"], "wall": not reused}  # fmt: skip
            rm = tt.get("methods", {}).get(m) if tt["ok"] else None
            if rm is not None:
                keep = ("seeds", "reached", "interval", "upper_bound")
                row.update(ok=True, why="", speedup=rm["speedup"], **{k: rm[k] for k in keep})
            elif tt["ok"]:
                row["why"] = f"method {m} has no runs on the passing seeds"
            out.append(row)
    return out


def markdown(trend: list[dict]) -> str:
    lines = [
        "Speedup over the baseline's plateau against resolution (each size's own headline, docs/speedup.md):",
        "",
        "| size | px | rendering | method | seeds reaching | "
        + " | ".join(f"speedup {report.COST_NAMES[k]}" for k in COSTS) + " | speedup wall s |",
        "|---" * (6 + len(COSTS)) + "|",
    ]  # fmt: skip
    for r in trend:
        head = f"| {r['size']} | {r['resolution']} | {r['render']} | {report.label(r['method'])} |"
        if not r["ok"]:
            lines.append(f"{head} - | **{r['why']}** |" + " - |" * len(COSTS))
            continue
        cells = [report.speedup_cell(r, k) for k in (*COSTS, "wall_s")]
        if not r["wall"]:
            cells[-1] = "- (reused runs)"
        lines.append(f"{head} {r['reached']}/{r['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "`<=`: some seed never reached the target (censored at the full budget): an upper bound. "
              "[lo, hi]: 95% bootstrap over seeds and captions; (range lo-hi): fewer than 5 seeds."]  # fmt: skip
    return "\n".join(lines) + "\n"


def series(trend: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The plot's lines: one per (method, rendering), its measurable rows by increasing resolution. A point in another
    rendering starts its own line rather than joining one at the same resolution."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in trend:
        if r["ok"]:
            out.setdefault((r["method"], r["render"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["resolution"]) for k, v in out.items()}


def plot(trend: list[dict], path) -> Path:
    """Speedup (log) against resolution (log2), one panel per cost, one line per method and rendering; the interval
    as error bars (solid: a 95% interval, dashed: the range of fewer seeds); an open marker where the ratio is an
    upper bound, "never reached" beside it where no seed reached the target (the ratio is a bound and no speedup).
    Rows without a measurable speedup are left out (the table says why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = series(trend)
    renders = list(dict.fromkeys(r for _, r in lines))
    fig, axes = plt.subplots(1, len(COSTS), figsize=(6 * len(COSTS), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10")
    xs = sorted({r["resolution"] for r in trend})
    for ax, cost in zip(axes[0], COSTS, strict=True):
        for i, ((m, render), pts) in enumerate(lines.items()):
            x = [r["resolution"] * 2 ** (0.03 * (i - len(lines) / 2)) for r in pts]  # apart, not hiding each other
            y = [r["speedup"][cost][0] for r in pts]
            name = report.label(m) + (f", {RENDER_NAMES.get(render, render)} rendering" if len(renders) > 1 else "")
            ax.plot(x, y, color=colors(i), lw=1.5, label=name)
            for xi, r in zip(x, pts, strict=True):
                c, lo, hi = r["speedup"][cost]
                bars = ax.errorbar([xi], [c], yerr=[[max(c - lo, 0.0)], [max(hi - c, 0.0)]], color=colors(i), capsize=3,
                                   marker="os^D"[renders.index(render) % 4],
                                   mfc="none" if r["upper_bound"] else colors(i))  # fmt: skip
                if r["interval"] == "range":
                    bars[-1][0].set_linestyle("--")
                if r["reached"] == 0:  # a bound only: the method never reached the target
                    ax.annotate("never reached", (xi, c), xytext=(6, -3), textcoords="offset points", fontsize=7,
                                color=colors(i))  # fmt: skip
        ax.axhline(1.0, color="k", lw=1, ls=":", label="as fast as the baseline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x} px" for x in xs])
        lo, hi = ax.get_ylim()
        ticks = [t for t in YTICKS if lo <= t <= hi]
        ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
        ax.set_xlabel("resolution")
        ax.set_ylabel(f"speedup in {report.COST_NAMES[cost]} (x)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("speedup over the baseline against resolution (open: upper bound; dashed: range of < 5 seeds)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check(out_dirs, out) -> str:
    """The dry run: every directory exists; those whose headline has finished (results.json) fit one trend. Returns
    what the command would do."""
    missing = [str(d) for d in out_dirs if not Path(d).is_dir()]
    if missing:
        raise TrendError(f"not a directory: {', '.join(missing)}: --trend takes the --out directories of benchmarks")
    done = [d for d in out_dirs if (Path(d) / "results.json").is_file()]
    n = len(rows([load(d) for d in done])) if done else 0
    pending = [str(d) for d in out_dirs if d not in done]
    left = f"; not finished yet (no results.json): {', '.join(pending)}" if pending else ""
    return f"would write the trend of {n} rows from {len(done)} finished benchmarks into {out}{left}"


def write(out_dirs, out) -> list[dict]:
    """trend.md, trend.json and trend.png in `out` from the benchmarks in `out_dirs`. Returns the rows."""
    trend = rows([load(d) for d in out_dirs])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trend.json").write_text(json.dumps(trend, indent=1))
    (out / "trend.md").write_text(markdown(trend))
    plot(trend, out / "trend.png")
    return trend

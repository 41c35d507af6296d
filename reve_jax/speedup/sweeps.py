"""The sweeps: each method's learning rate, then its guidance scale, chosen the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from reve_jax.speedup.protocol import PRIMARY, Protocol, build_config
from reve_jax.speedup.runner import Runner


def sweep(
    size: Protocol,
    out_dir,
    methods,
    *,
    extra=(),
    cache_dir=None,
    evaluator_kwargs=None,
    max_extend: int = 2,
    rate: str = "lr",
    seeds: tuple[int, ...] | None = None,
    archive=None,
    log: Callable[[str], None] = print,
) -> dict:
    """For each method, on `seeds` (default: the size's tuning seeds, never the headline's): the grid of `rate` (the
    size's `sweep_grid`: its `sweep_lrs`, or the span `sweep_around` the method's frozen rate)
    (each run evaluated at the end only, with the tuning noise seed; a rate's score is its mean over the seeds),
    extended by factors of 2 while the best sits at an edge (at most `max_extend` times); a Muon arm's grid of a rate
    reaches, in factors of 2, the value the size's `sweep_from` says its other sweep held that rate at (that point is
    the other sweep's winner's run: reused, not trained again; a coordinate sweep never drops a point it measured),
    then the guidance scales
    on the winner's final EMA weights (mean over the seeds; each sweep run's record holds its scores). Rates are
    scored at the method's frozen guidance; when the winner's best guidance is another scale, the grid is re-scored
    at that one from the same records (every run holds every scale), extended again if its winner moved to an edge,
    until the guidance comes back the one the rates were scored at. Two seeds
    choose a rate that holds on both where one seed may pick a rate at the edge of stability. `rate` is one of
    RATES ("muon_lr" sweeps Muon's group with the main group at its frozen rate; sweep_all chains both). `archive`:
    Runner's (finished runs' records kept across machines). Writes <out>/sweep.json ({method: ...}, or
    {method@muon_lr: ...}) and returns {method: {rate: best, "cfg_scale", "grid": {rate: mean align}, "per_seed":
    {seed: {rate: align}}, "runs", "scored_at", "rescored": the scales tried before it, ...}}."""
    out = Path(out_dir)
    runner = Runner(size, out, extra, cache_dir, evaluator_kwargs, log, archive)
    seeds = tuple(seeds or size.tune_seeds)
    result = {}
    for method in methods:
        frozen = build_config(size, method, seeds[0], extra)  # the incumbent rate and scale win exact ties
        records: dict[tuple[int, float], dict] = {}
        grid = _reaching(size.sweep_grid(getattr(frozen.optim, rate)), size.sweep_from.get(method, {}).get(rate))
        incumbent, scale, tried = getattr(frozen.optim, rate), float(frozen.sample.cfg_scale), []
        while True:
            best, scores, per_seed = _rates(runner, method, seeds, grid, records, scale, incumbent, max_extend, rate)
            by_seed = [records[seed, best]["cfg_scores"] for seed in seeds]  # the winner's, scored when it finished
            scales = {k: float(np.mean([g[k] for g in by_seed])) for k in by_seed[0]}
            chosen = float(pick(scales, f"{scale:g}"))
            tried.append(scale)
            if chosen == scale:  # it ends: each pass's best (rate, scale) scores higher than the last's
                break
            log(f"sweep {method}: guidance {chosen:g} beats {scale:g} on the winner ({rate} {best:g}): the grid "
                f"re-scored at {chosen:g} from the same runs")  # fmt: skip
            incumbent, scale, grid = best, chosen, []
        inside = min(scores) < best < max(scores)
        r = result[method] = {rate: best, "inside_grid": inside, "grid": _by_rate(scores), "seeds": list(seeds),
                              "runs": len(records),
                              "per_seed": {seed: _by_rate(d) for seed, d in per_seed.items()},
                              "cfg_scale": chosen, "cfg_scores": scales,
                              "scored_at": scale, "rescored": tried[:-1]}  # fmt: skip
        log(f"sweep {method}: {rate} {best:g} ({'inside' if inside else 'AT THE EDGE of'} the grid {r['grid']}, "
            f"seeds {list(seeds)}), guidance {r['cfg_scale']:g} ({scales})")  # fmt: skip
        path = out / "sweep.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved.update({(m if rate == "lr" else f"{m}@{rate}"): r for m, r in result.items()})
        path.write_text(json.dumps(saved, indent=1))
        (out / "sweep.md").write_text(markdown(saved))
    return result


def _rates(runner, method, seeds, grid, records, scale, incumbent, max_extend, rate):
    """One pass over the rates at guidance `scale`: trains the grid's points not in `records` (filled in place) on
    every seed, scores every point measured so far, and extends the grid by a factor 2 past the best while it sits
    at an edge (at most `max_extend` times). Returns (best rate, {rate: mean score}, {seed: {rate: score}})."""
    for _ in range(max_extend + 1):
        for lr in grid:
            for seed in seeds:
                if (seed, lr) not in records:
                    records[seed, lr] = runner.run(method, seed, lr, evals=1, rate=rate, tuning=True)
        per_seed = {seed: {lr: sweep_score(records[seed, lr], scale) for (s, lr) in records if s == seed}
                    for seed in seeds}  # fmt: skip
        scores = {lr: float(np.mean([per_seed[seed][lr] for seed in seeds])) for lr in per_seed[seeds[0]]}
        best = pick(scores, incumbent)
        if min(scores) < best < max(scores):
            break
        grid = [best / 2 if best == min(scores) else best * 2]
    return best, scores, per_seed


def markdown(saved: dict) -> str:
    """Every sweep of sweep.json in one table (issue 45: each method's sweep runs side by side): a row per method,
    rate group and value, each tuning seed's final alignment and their mean, the winner in bold (flagged when at
    the grid's edge after the last extension), then the guidance scales on the winner (mean over the seeds). A rate's
    rows name the guidance scale they were scored at (the frozen one, or the one it settled on) where the record
    holds it."""
    seeds = sorted({int(s) for r in saved.values() for s in r["per_seed"]})

    def bold(text: str, yes: bool) -> str:
        return f"**{text}**" if yes else text

    lines = ["| method | rate | value | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | runs |",
             "|---" * (len(seeds) + 5) + "|"]  # fmt: skip
    for name, r in saved.items():
        method, _, rate = name.partition("@")
        rate = rate or "lr"
        per_seed = {int(s): v for s, v in r["per_seed"].items()}
        for i, (value, mean) in enumerate(r["grid"].items()):
            win = float(value) == r[rate]
            cells = [f"{per_seed[s][value]:.3f}" if value in per_seed.get(s, {}) else "-" for s in seeds]
            edge = " (at the grid's edge)" if win and not r["inside_grid"] else ""
            label = f"{rate} (at guidance {r['scored_at']:g})" if "scored_at" in r else rate
            row = [method, label, bold(value, win) + edge, *cells, bold(f"{mean:.3f}", win), str(r["runs"]) * (i == 0)]
            lines.append("| " + " | ".join(row) + " |")
        for scale, mean in r["cfg_scores"].items():
            row = [method, f"guidance (at {rate} {r[rate]:g})", scale, *([""] * len(seeds))]
            lines.append("| " + " | ".join([*row, bold(f"{mean:.3f}", float(scale) == r["cfg_scale"]), ""]) + " |")
    return "\n".join(lines) + "\n"


def sweep_all(size: Protocol, out_dir, methods, *, extra=(), log: Callable[[str], None] = print, **kwargs) -> dict:
    """The same sweep for every method (equal effort): its main (AdamW) rate on the grid, then, for a Muon arm,
    Muon's rate on the same grid with the main rate at its winner, then the guidance scales on the last winner; each
    rate's grid extended alike while its winner sits at an edge. Returns {method: {"lr", "muon_lr"?, "cfg_scale",
    "runs", "sweeps": {rate: the sweep's record}}}."""
    result = {}
    for method in methods:
        first = sweep(size, out_dir, [method], extra=extra, log=log, rate="lr", **kwargs)[method]
        row = {"lr": first["lr"], "cfg_scale": first["cfg_scale"], "runs": first["runs"], "sweeps": {"lr": first}}
        if build_config(size, method, size.tune_seeds[0], tuple(extra)).optim.name == "muon":
            pinned = (*extra, f"optim.lr={first['lr']!r}")
            second = sweep(size, out_dir, [method], extra=pinned, log=log, rate="muon_lr", **kwargs)[method]
            row.update(muon_lr=second["muon_lr"], cfg_scale=second["cfg_scale"], runs=row["runs"] + second["runs"])
            row["sweeps"]["muon_lr"] = second
        result[method] = row
        log(
            f"sweep {method}: {', '.join(f'{k} {row[k]:g}' for k in ('lr', 'muon_lr', 'cfg_scale') if k in row)} "
            f"({row['runs']} runs)"
        )
    return result


def sweep_score(rec: dict, cfg_scale: float) -> float:
    """A sweep run's final alignment at the guidance scale `cfg_scale` (the method's frozen one): its last
    evaluation's when it ran at that scale, else its score there among those at every scale of the size (the same
    weights, captions and noise); -inf for a run without one (diverged)."""
    if rec.get("diverged") or not rec["curve"]:
        return float("-inf")
    if rec.get("cfg_scale", cfg_scale) != cfg_scale:
        return float(rec["cfg_scores"][f"{cfg_scale:g}"])
    return rec["curve"][-1][PRIMARY]


def pick(scores: dict, incumbent):
    """The key of the highest score; on an exact tie the incumbent (the size's frozen value) when it is among the
    tied, else the first tied key in `scores`' order: a sweep that cannot tell two settings apart keeps what is
    frozen rather than moving on the order of a list."""
    top = max(scores.values())
    tied = [k for k, v in scores.items() if v == top]
    return incumbent if incumbent in tied else tied[0]


def _reaching(grid: list[float], held: float | None) -> list[float]:
    """`grid` extended by factors of 2 until it reaches `held` (None: unchanged)."""
    if held is None:
        return grid
    above = [held / 2**k for k in range(64) if held / 2**k > grid[-1] * 1.5]
    below = [held * 2**k for k in range(64) if held * 2**k < grid[0] / 1.5]
    return sorted({*grid, *above, *below, held})


def _by_rate(scores: dict[float, float]) -> dict[str, float]:
    """{rate: score} with the rates as JSON keys ('0.002'), in increasing order."""
    return {f"{k:g}": v for k, v in sorted(scores.items())}

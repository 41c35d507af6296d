"""Scoring a run's checkpoint (scripts/evaluate.py): restore its EMA weights with the config saved beside them,
run the Evaluator on n held-out captions, and write what it found.

Every number names its caption set: "unseen" (captions with a composition the run never trained on: what the model
generalizes to, the headline) and "seen" (training-like captions from a stream the run never read: fit).
Outputs, under <workdir>/evaluation/ unless told otherwise:
- step_<N>.json: {"workdir", "step", "n", "seed", "config", "heldout_compositions", "splits": {split: {"metrics"
  (the Evaluator's flat dict: alignment per attribute, align_exact and align_overall with 95% bootstrap
  intervals, KID and its floor, the controls, v-loss), "captions": [{"index", "caption", "checks": {attribute:
  [passed, total]}}], "groups" (align_exact and align_shape by the held-out pairs a caption holds and by its
  objects' size: alignment.by_group)}}, "feature_net" (its held-out per-object accuracy)}; with `regions`, also
  "regions": the KID with each region around the objects given back its real pixels (first split);
- step_<N>.png: the first `grid` generated images of the first split with their captions, each caption's checks
  marked.

With `denoise_checkpoint` (scripts/evaluate.py --denoise): denoise_step_<N>.json (the table of denoise.py, with
"workdir", "step", "n", "seed", "times") and denoise_step_<N>.png (its grid, 4x enlarged).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
from PIL import Image

from reve_jax import cli, config, viz
from reve_jax.data import pipeline
from reve_jax.data.synthetic import alignment
from reve_jax.metrics import denoise, quality
from reve_jax.metrics import regions as regions_lib
from reve_jax.train import sampling


def score_checkpoint(
    workdir: str | Path,
    step: int | None = None,
    n: int = 512,
    seed: int = 4321,
    out_dir: str | Path | None = None,
    grid: int = 32,
    log=print,
    sample: dict | None = None,
    regions: bool = False,
    splits: tuple[str, ...] | None = None,
    **evaluator_kwargs,
) -> tuple[dict, Path, Path]:
    """Scores checkpoint `step` (default: the newest) of `workdir` on `n` captions of each evaluation split in
    `splits` (default: unseen and seen compositions, pipeline.eval_splits) with noise `seed`; `sample` overrides
    keys of the run's `sample` section (sampler, steps, cfg_scale: how the images are drawn, e.g. {"steps": 48});
    `regions`: also the KID with each region around the objects given back its real pixels, on the first split
    (regions.py; the JSON's "regions"); `evaluator_kwargs` go to quality.Evaluator (n_boot, cache_dir,
    dinov2_path, ...). Writes the JSON and the PNG described in the module docstring (with the overrides in their
    names); returns (the JSON's content, its path, the PNG's path)."""
    t0 = time.perf_counter()
    r = sampling.restore_for_sampling(workdir, step)
    cfg, graphdef, ema, step, mesh = r.cfg, r.graphdef, r.params, r.step, r.mesh
    sample = {k: v for k, v in (sample or {}).items() if v is not None}
    if sample:  # on the config just read from the checkpoint; an unknown key or a wrong type is a ConfigError
        for k, v in sample.items():
            config.apply_override(cfg, f"sample.{k}={v!r}")
        config.validate(cfg)
    splits = tuple(splits or pipeline.eval_splits(cfg.data))
    log(f"restored step {step} of {workdir} ({time.perf_counter() - t0:.1f}s); scoring {n} captions of {splits}")
    result = {
        "workdir": str(workdir),
        "step": step,
        "n": n,
        "seed": seed,
        "config": json.loads(config.to_json(cfg)),
        "heldout_compositions": pipeline.heldout_compositions(cfg.data).describe(),
        "splits": {},
    }
    first = None
    for name in splits:
        ev = quality.Evaluator(cfg, graphdef, n, seed, mesh=mesh, split=name, **evaluator_kwargs)
        images = ev.generate(ema)
        metrics = ev(ema, images=images)
        checks = ev.checks(images)
        rows = [{a: [int(v) for v in checks[a][i]] for a in alignment.ATTRIBUTES} for i in range(n)]
        captions = [ev.dataset.caption(int(i)) for i in ev.heldout["index"]]
        groups = alignment.by_group(checks, ev.scenes, ev.dataset.heldout)
        result["splits"][name] = {
            "metrics": metrics,
            "groups": groups,
            "captions": [
                {"index": int(i), "caption": c, "checks": r}
                for i, c, r in zip(ev.heldout["index"], captions, rows, strict=True)
            ],
        }
        result["feature_net"] = ev.feature_info and {k: v for k, v in ev.feature_info.items() if k.startswith("test_")}
        log(f"{name} compositions, {n} captions:\n{summary_line(metrics)}\n{groups_line(groups)}")
        if first is None:
            first = (ev, images, captions, rows)
    ev, images, captions, rows = first
    if regions:
        result["regions"] = regions_lib.by_region(ev, images)
    result["elapsed_s"] = time.perf_counter() - t0
    out = Path(out_dir) if out_dir else Path(workdir) / "evaluation"
    out.mkdir(parents=True, exist_ok=True)
    name = f"step_{step}" + "".join(f"_{k}{v}" for k, v in sorted(sample.items()))
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=1))
    k = min(grid, n)
    viz.save_checked_grid(png_path, images[:k], captions[:k], [{a: tuple(r[a]) for a in r} for r in rows[:k]])
    if regions:
        log(regions_lib.format_table(result["regions"]))
    return result, json_path, png_path


def denoise_checkpoint(
    workdir: str | Path,
    step: int | None,
    times,
    n: int = 64,
    seed: int = 0,
    out_dir: str | Path | None = None,
    log=print,
) -> tuple[dict, Path, Path]:
    """Runs the denoising probe (denoise.py) on checkpoint `step` (default: the newest) of `workdir`; writes its
    JSON and grid, logs its table. Returns (the JSON's content, its path, the PNG's path)."""
    r = sampling.restore_for_sampling(workdir, step)
    cfg, graphdef, ema, step, mesh = r.cfg, r.graphdef, r.params, r.step, r.mesh
    with jax.set_mesh(mesh):
        table, grid = denoise.probe(cfg, graphdef, ema, times, n, seed)
    result = {"workdir": str(workdir), "step": step, "n": n, "seed": seed, "times": list(times), **table}
    out = Path(out_dir) if out_dir else Path(workdir) / "evaluation"
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"denoise_step_{step}.json", out / f"denoise_step_{step}.png"
    json_path.write_text(json.dumps(result, indent=1))
    Image.fromarray(viz.to_uint8(grid)).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(png_path)
    log(f"step {step} of {workdir}, {n} held-out images (rows of the grid: clean, then noisy input and x_hat per t)")
    log(denoise.format_table(table, times))
    return result, json_path, png_path


def groups_line(groups: dict) -> str:
    """One line: align_exact (and the number of captions) of each caption group of alignment.by_group."""
    return "exact by caption: " + "  ".join(f"{g} {v['align_exact']:.3f} ({v['n']})" for g, v in groups.items())


def summary_line(m: dict) -> str:
    """One line per metric family: value [95% interval] (no interval without bootstrap resamples), with the floor
    and the controls beside KID."""

    def ci(name, fmt="{:.3f}"):
        if name not in m:
            return ""
        lo, hi = m.get(f"{name}_lo", np.nan), m.get(f"{name}_hi", np.nan)
        interval = f" [{fmt.format(lo)}, {fmt.format(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else ""
        return f"{name} {fmt.format(m[name])}{interval}"

    attrs = [ci(f"align_{a}") for a in alignment.ATTRIBUTES]
    lines = ["  ".join([ci("align_exact"), ci("align_overall")]), "  ".join(attrs[:3]), "  ".join(attrs[3:])]
    if "kid" in m:
        lines.append(f"{ci('kid', '{:.4f}')}  floor {ci('kid_floor', '{:.4f}').removeprefix('kid_floor ')}")
    ctrl = [
        f"{name} {m[f'ctrl_{name}_align_overall']:.3f}"
        + (f"/{m[f'ctrl_{name}_kid']:.3f}" if f"ctrl_{name}_kid" in m else "")
        for name in ("real", "shuffled", "background", "one_object")
        if f"ctrl_{name}_align_overall" in m
    ]
    if ctrl:
        lines.append("controls (align_overall/kid): " + "  ".join(ctrl))
    lines.append(f"vloss {m.get('vloss', np.nan):.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv=None, doc: str = __doc__):
    """scripts/evaluate.py: score a checkpoint (score_checkpoint) or run the denoising probe (denoise_checkpoint)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a run directory with checkpoints/")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="held-out captions to score (default 512, the final numbers; 64 with --denoise)",
    )
    parser.add_argument("--seed", type=int, default=4321, help="sampling noise seed")
    parser.add_argument("--out", default=None, help="output directory (default <workdir>/evaluation)")
    parser.add_argument("--boot", type=int, default=1000, help="bootstrap resamples for the intervals")
    parser.add_argument("--cache-dir", default=None, help="feature net cache (default ~/.cache/reve_jax)")
    parser.add_argument("--dinov2", default=None, help="converted DINOv2 weights for fd_dinov2 (optional)")
    parser.add_argument(
        "--sampler", choices=config.CHOICES["sample.sampler"], help="sample with this sampler (default: the run's)"
    )
    parser.add_argument("--steps", type=int, help="sampling steps (default: the run's sample.steps)")
    parser.add_argument("--cfg-scale", type=float, help="guidance scale (default: the run's sample.cfg_scale)")
    parser.add_argument(
        "--t-eps",
        type=float,
        help="the sampler's x-prediction clamp, sample.t_eps: 0 exact, -1 training's (default: the run's)",
    )
    parser.add_argument(
        "--splits",
        default=None,
        help="comma-separated caption sets: unseen, seen (default: both, or seen for a run that held nothing out)",
    )
    parser.add_argument(
        "--regions",
        action="store_true",
        help="also the KID with each region around the objects given back its real pixels (data.render='fixed')",
    )
    parser.add_argument(
        "--denoise", default=None, help="comma-separated times in [0, 1), e.g. 0.5,0.85,0.95,0.99: the denoising probe"
    )
    args = parser.parse_args(argv)
    cli.setup_logging()
    if args.denoise is not None:
        try:
            times = tuple(float(t) for t in args.denoise.split(","))
        except ValueError:
            parser.error(f"--denoise {args.denoise!r}: give comma-separated numbers, e.g. 0.5,0.85,0.95,0.99")
        _, json_path, png_path = denoise_checkpoint(args.workdir, args.step, times, args.n or 64, args.seed, args.out)
        print(json_path)
        print(png_path)
        return

    _, json_path, png_path = score_checkpoint(
        args.workdir,
        args.step,
        args.n or 512,
        args.seed,
        args.out,
        n_boot=args.boot,
        cache_dir=args.cache_dir,
        dinov2_path=args.dinov2,
        sample={"sampler": args.sampler, "steps": args.steps, "cfg_scale": args.cfg_scale, "t_eps": args.t_eps},
        regions=args.regions,
        splits=tuple(args.splits.split(",")) if args.splits else None,
    )
    print(json_path)
    print(png_path)

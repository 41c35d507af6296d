"""The speedup benchmark: the recipe and each single technique against a DiT baseline, in steps, samples, FLOPs
and wall clock to first reach the baseline's final quality (RECIPE.md section 7).

Protocol. The baseline (configs/recipe/baseline.py) trains to its budget with a cosine learning rate decayed to 0,
once per learning rate of a small sweep; the LR with the best final alignment wins, and the baseline's final
alignment (mean over seeds) is the target. Then the full recipe and every ablation (baseline + one technique)
train with the same budget, schedule and LR. Every run evaluates its EMA weights every `eval_every` steps
(`Evaluator`: fixed captions, noise, sampler, steps and guidance) and records, at each evaluation, the step, the
samples and executed FLOPs so far (`flops.train_flops_per_image` x samples), and the training wall clock and
process CPU time so far: the clock stops (after `block_until_ready`) while evaluating, and compilation is timed
apart. Steps to target = the first evaluated step whose metric reaches the target and holds it at the next
evaluation (`SUSTAIN`; no interpolation: an upper bound, `eval_every` steps coarse); "not reached" when none does.

Runs use the train step of the trainer (`train_state.jit_train_step`) and its input pipeline in a loop of their own,
so evaluation can read the live EMA weights without checkpoint writes in the timed path. Finished runs are stored
as JSON under `<out>/runs/` and reused when the benchmark is started again with the same settings.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from reve_jax import config as config_lib
from reve_jax import flops, sharding, train_state, viz
from reve_jax.data import pipeline
from reve_jax.eval import alignment, features, quality
from reve_jax.eval.report import write_outputs

PRIMARY = "align_overall"
# Metric -> True when higher is better.
DIRECTION = {"align_overall": True, "align_exact": True, "fd_shapes": False, "fd_dinov2": False, "vloss": False}
RECIPE = ("jit", "bottleneck", "tread", "muon")
# A crossing must hold for this many consecutive evaluations: early, half-formed samples can pass a few checks
# by luck, and a single evaluation of ~100 images is noisy.
SUSTAIN = 2


@dataclasses.dataclass(frozen=True)
class BenchSize:
    """One benchmark size. base: configs/<base>.py; overrides: applied to it before the techniques (model and
    data size); train: applied after them (budget, batch, schedule, sampler). lrs: the baseline's LR sweep."""

    name: str
    base: str
    overrides: tuple[str, ...]
    train: tuple[str, ...]
    steps: int
    eval_every: int
    n_eval: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    methods: tuple[str, ...] = ("recipe", "jit", "bottleneck", "tread", "muon")
    eval_seed: int = 4321


_COMMON_TRAIN = (
    "optim.schedule='cosine'",
    "optim.min_lr_ratio=0.0",
    "train.sample_every=0",
    "train.stop_on_nan=True",
    "data.worker_threads=1",
    "sample.sampler='euler'",
    "sample.cfg_scale=3.0",
)


def _cpu_size(name: str, image_size: int, patch: int, batch: int, steps: int, lrs: tuple[float, ...]) -> BenchSize:
    """A 3-block, width-128 DiT on one-object scenes (16 caption tokens), evaluated 10 times on 96 captions."""
    return BenchSize(
        name=name,
        base="tiny",
        overrides=(
            "model.width=128",
            "model.depth=3",
            "model.heads=4",
            f"model.patch={patch}",
            "text.width=64",
            "text.depth=1",
            "text.heads=2",
            "text.max_len=16",
            f"data.image_size={image_size}",
            "data.max_objects=1",
        ),
        train=(
            *_COMMON_TRAIN,
            f"train.global_batch={batch}",
            "optim.warmup_steps=50",
            "ema.decays=(0.99,)",
            "sample.steps=12",
        ),
        steps=steps,
        eval_every=steps // 10,
        n_eval=96,
        lrs=lrs,
        seeds=(0, 1),
    )


SIZES = {
    # About 25 minutes on 2 CPU cores, in JiT's regime: 32 px scenes in 8 px patches, so each of the 16 image tokens
    # carries 192 values for a width-128 model (patch dimension > width, as ViT/16 at 256 px: 768 values, width 768
    # for B); batch 32, 1,000 steps.
    "cpu": _cpu_size("cpu", image_size=32, patch=8, batch=32, steps=1000, lrs=(1e-3, 2e-3, 4e-3)),
    # The same model on 16 px images in 4 px patches (48 values per token, far below the width): outside JiT's
    # regime. Kept for comparison; its results are in docs/speedup.md.
    "cpu-p4": _cpu_size("cpu-p4", image_size=16, patch=4, batch=16, steps=1500, lrs=(2e-3, 4e-3, 8e-3)),
    # Sized by arithmetic for ~8 minutes on one H200 (not yet run on one): JiT's regime at 128 px, 16 px patches
    # (768 values per token, twice the width), 64 image tokens, scenes of up to 3 objects, an 8-block width-384 DiT.
    "gpu": BenchSize(
        name="gpu",
        base="tiny",
        overrides=(
            "model.width=384",
            "model.depth=8",
            "model.heads=6",
            "model.patch=16",
            "model.bottleneck=128",
            "model.dtype='bfloat16'",
            "text.width=128",
            "text.depth=2",
            "text.heads=4",
            "text.max_len=32",
            "data.image_size=128",
            "data.max_objects=3",
        ),
        train=(
            *_COMMON_TRAIN,
            "train.global_batch=128",
            "optim.warmup_steps=100",
            "ema.decays=(0.998,)",
            "sample.steps=20",
            "data.worker_threads=8",
        ),
        steps=2000,
        eval_every=200,
        n_eval=512,
        lrs=(5e-4, 1e-3, 2e-3),
        seeds=(0, 1),
    ),
}


def enable_compile_cache(path: str | Path) -> None:
    """Persistent XLA compilation cache in `path`: runs that differ only in seed compile the same programs, so
    later ones load them instead of compiling (compilation is outside the timed training either way)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def machine() -> dict:
    """Where the benchmark ran: host, CPU count, JAX devices and the load average (other users' work counts)."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "loadavg": list(os.getloadavg()),
    }


def _recipe_common():
    """configs/recipe/common.py (the techniques as config functions), importable from the repository root."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("configs.recipe.common")


def techniques_of(method: str) -> tuple[str, ...]:
    """'baseline' -> (), 'recipe' -> RECIPE, 'recipe+ddt' -> RECIPE + ('ddt',), a technique name -> (name,)."""
    if method == "baseline":
        return ()
    if method.startswith("recipe"):
        return RECIPE + tuple(t for t in method.split("+")[1:] if t)
    return tuple(method.split("+"))


def build_config(size: BenchSize, method: str, lr: float, seed: int, extra: tuple[str, ...] = ()):
    """The config of one run: the size's base config shrunk by its overrides, made the baseline, the method's
    techniques switched on, then the size's training settings, the LR, the seed and `extra` overrides."""
    common = _recipe_common()
    c = common.sized(size.base)
    for item in size.overrides:
        config_lib.apply_override(c, item)
    rank = c.model.bottleneck or 32
    c = common.baseline(c)
    for t in techniques_of(method):
        c = common.apply(c, t, rank)
    for item in (*size.train, f"train.steps={size.steps}", f"optim.lr={lr!r}", f"seed={seed}", *extra):
        config_lib.apply_override(c, item)
    config_lib.validate(c)
    return c


def _finite(metrics: dict) -> bool:
    return all(math.isfinite(float(v)) for v in metrics.values())


def train_run(
    cfg,
    eval_every: int,
    evaluator_kwargs: dict,
    n_eval: int,
    eval_seed: int,
    on_eval=None,
    grid_path=None,
    images_path=None,
) -> dict:
    """Trains `cfg` for `cfg.train.steps`, evaluating the EMA weights every `eval_every` steps and at the end.

    Returns a JSON-able record: {"curve": [{"step", "samples", "flops", "wall_s", "cpu_s", <metrics>}, ...],
    "compile_s", "step_flops", "diverged" (step or None), "config"}. wall_s and cpu_s are training time only
    (cumulative), measured with the step's outputs ready. `on_eval(point)` is called after each evaluation;
    `grid_path`: a PNG of the final evaluation's first 16 images with their captions; `images_path`: an .npz of
    every evaluation's images (uint8, keys step_<n>, and the held-out `index`).
    """
    mesh = sharding.make_mesh(cfg.mesh)
    setup = train_state.make_setup(cfg, mesh)
    state = train_state.init_state(setup)
    batch_size = cfg.train.global_batch
    it = pipeline.make_batch_iterator(cfg.data, cfg.text.max_len, batch_size, 0, 1, 0)
    keys = ("image", "tokens", "text_emb", "text_mask")
    to_device = lambda local: sharding.global_batch_from_local(  # noqa: E731
        {k: v for k, v in local.items() if k in keys}, mesh, batch_size
    )
    batch = to_device(next(it))
    t0 = time.perf_counter()
    step_fn = train_state.jit_train_step(setup, jax.tree.map(lambda a: a.sharding, batch))
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(state, batch, setup.frozen.states).compile()
    evaluator = quality.Evaluator(cfg, setup.graphdef, n_eval, eval_seed, mesh=mesh, **evaluator_kwargs)
    compile_s = time.perf_counter() - t0
    img_flops = flops.train_flops_per_image(cfg)
    record = {"curve": [], "compile_s": compile_s, "step_flops": img_flops * batch_size, "diverged": None}
    record["machine_start"] = machine()
    wall = cpu = 0.0
    kept = {}  # every evaluation's images, uint8, so the metrics can be recomputed later without retraining
    w0, c0 = time.perf_counter(), time.process_time()
    for step in range(1, cfg.train.steps + 1):
        with jax.set_mesh(mesh):
            state, m = compiled(state, batch, setup.frozen.states)
        if step < cfg.train.steps:
            batch = to_device(next(it))
        if step % eval_every and step != cfg.train.steps:
            continue
        jax.block_until_ready(state)
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        train_metrics = {k: float(v) for k, v in jax.device_get(m).items()}
        if not _finite(train_metrics):
            record["diverged"] = step
            break
        point = {
            "step": step,
            "samples": step * batch_size,
            "flops": step * batch_size * img_flops,
            "wall_s": wall,
            "cpu_s": cpu,
            "train_loss": train_metrics["loss"],
        }
        ema = state["ema"]["ema0"]
        images = evaluator.generate(ema)
        point.update(evaluator(ema, images=images))
        kept[f"step_{step}"] = np.rint((images + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
        if grid_path is not None and step == cfg.train.steps:
            captions = pipeline.captions_of(pipeline.dataset_from_config(cfg.data), evaluator.heldout["index"][:16])
            viz.save_sample_grid(grid_path, images[:16], captions)
        record["curve"].append(point)
        if on_eval is not None:
            on_eval(point)
        w0, c0 = time.perf_counter(), time.process_time()
    record["machine_end"] = machine()
    if images_path is not None:
        np.savez_compressed(images_path, index=evaluator.heldout["index"], **kept)
    return record


# ------------------------------------------------------------------------------------------ analysis


def first_reach(
    steps, values, target: float, higher_is_better: bool = True, interpolate: bool = False, sustain: int = 1
):
    """The first step at which `values` (measured at increasing `steps`) reach `target`, or None if none does.

    sustain: an evaluation counts only if it and the next `sustain - 1` evaluations all reach the target (those
    the run has: the last evaluation counts alone), so one lucky evaluation of a noisy metric is not a crossing.
    Without interpolation, the first evaluated step that counts (an upper bound, as coarse as the evaluation
    cadence). With it, the crossing is placed on the straight line between the evaluation before it and it (the
    first evaluation itself when it already counts). NaN values never reach.
    """
    steps = np.asarray(steps, np.float64)
    v = np.asarray(values, np.float64)
    sign = 1.0 if higher_is_better else -1.0
    ok = np.nan_to_num(sign * v, nan=-np.inf) >= sign * target
    held = np.array([ok[i : i + max(1, sustain)].all() for i in range(len(ok))], bool)
    if not held.any():
        return None
    i = int(np.argmax(held))
    if not interpolate or i == 0:
        return float(steps[i])
    a, b = sign * v[i - 1], sign * v[i]
    frac = min(max((sign * target - a) / (b - a), 0.0), 1.0) if b != a else 1.0
    return float(steps[i - 1] + frac * (steps[i] - steps[i - 1]))


def final(curve: list[dict], metric: str):
    return curve[-1][metric] if curve and metric in curve[-1] else float("nan")


def reach(curve: list[dict], metric: str, target: float, sustain: int = SUSTAIN) -> dict | None:
    """Steps, samples, FLOPs, wall and CPU seconds at the first evaluation reaching `target` on `metric` (and
    holding it `sustain` evaluations, see first_reach); None when none does."""
    steps, values = [p["step"] for p in curve], [p.get(metric, np.nan) for p in curve]
    step = first_reach(steps, values, target, DIRECTION[metric], sustain=sustain)
    if step is None:
        return None
    point = next(p for p in curve if p["step"] == step)
    return {k: point[k] for k in ("step", "samples", "flops", "wall_s", "cpu_s")}


def targets_of(runs: dict, metrics=("align_overall", "fd_shapes", "vloss")) -> dict[str, float]:
    """The baseline's final value of each metric, averaged over its seeds: metric -> target."""
    base = [r for r in runs.values() if r["method"] == "baseline" and r["chosen"]]
    return {m: float(np.mean([final(r["curve"], m) for r in base])) for m in metrics if base}


def summarize(runs: dict, metric: str = PRIMARY, sustain: int = SUSTAIN) -> dict[str, dict]:
    """Per method: seeds, reached count, mean/std of steps, samples, flops, wall_s, cpu_s to reach the target on
    `metric` (see `reach`), speedups against the baseline (ratio of means over the seeds that reached), and final
    metrics (mean/std). Only runs marked `chosen` (the baseline at its chosen LR and every other method) count."""
    target = targets_of(runs, (metric,)).get(metric)
    by_method: dict[str, list[dict]] = {}
    for r in runs.values():
        if r["chosen"]:
            by_method.setdefault(r["method"], []).append(r)
    out = {}
    for method, rs in by_method.items():
        hits = [reach(r["curve"], metric, target, sustain) if target is not None else None for r in rs]
        got = [h for h in hits if h is not None]
        row = {"seeds": len(rs), "reached": len(got), "target": target}
        for k in ("step", "samples", "flops", "wall_s", "cpu_s"):
            vals = [h[k] for h in got]
            row[k] = (float(np.mean(vals)), float(np.std(vals))) if vals else None
        for m in ("align_overall", "align_exact", "fd_shapes", "fd_dinov2", "vloss"):
            vals = [final(r["curve"], m) for r in rs if m in r["curve"][-1]] if all(r["curve"] for r in rs) else []
            row[f"final_{m}"] = (float(np.mean(vals)), float(np.std(vals))) if vals else None
        sec = [p for r in rs for p in _step_seconds(r)]
        row["s_per_step"] = float(np.mean(sec)) if sec else None
        out[method] = row
    base = out.get("baseline")
    for row in out.values():
        for k in ("step", "wall_s", "cpu_s", "flops"):
            ok = base is not None and base[k] is not None and row[k] is not None
            row[f"speedup_{k}"] = base[k][0] / row[k][0] if ok else None
    return out


def _step_seconds(run: dict) -> list[float]:
    c = run["curve"]
    return [c[-1]["wall_s"] / c[-1]["step"]] if c else []


# ------------------------------------------------------------------------------------------ orchestration


def _run_key(size: BenchSize, method: str, lr: float, seed: int, extra) -> str:
    tag = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
    return f"{size.name}-{method}-lr{lr:g}-s{seed}" + (f"-{tag}" if tag else "")


def run_benchmark(
    size: BenchSize,
    out_dir: str | Path,
    *,
    extra: tuple[str, ...] = (),
    cache_dir: str | Path | None = None,
    dinov2_path: str | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Runs the whole benchmark of `size` into `out_dir` (runs/*.json, results.json, speedup.md, speedup.png),
    reusing finished runs found there. `extra` config overrides apply to every run. Returns the results dict."""
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir else out / "cache"
    ev_kwargs = {"cache_dir": cache_dir, "dinov2_path": dinov2_path}
    t_start = time.perf_counter()
    _, info = features.get_feature_net(features.DEFAULT_SPEC, cache_dir)
    log(f"feature net ready: held-out head accuracy {info['test_accuracy']}")
    runs: dict[str, dict] = {}

    def do(method: str, lr: float, seed: int) -> dict:
        key = _run_key(size, method, lr, seed, extra)
        path = out / "runs" / f"{key}.json"
        cfg = build_config(size, method, lr, seed, extra)
        if path.exists():
            rec = json.loads(path.read_text())
            if rec.get("config") == config_lib.to_json(cfg):
                log(f"[{key}] reused from {path}")
                runs[key] = rec
                return rec
        log(f"[{key}] training {size.steps} steps ({flops.train_flops_per_image(cfg) / 1e6:.1f} MFLOP per image)")

        def on_eval(p):
            log(
                f"[{key}] step {p['step']:5d}  train {p['wall_s']:7.1f}s  align {p['align_overall']:.3f}  "
                f"exact {p['align_exact']:.3f}  fd {p.get('fd_shapes', float('nan')):.3f}  vloss {p['vloss']:.4f}"
                f"  (eval {p['eval_s']:.1f}s)"
            )

        grid = out / "runs" / f"{key}.png"
        rec = train_run(
            cfg, size.eval_every, ev_kwargs, size.n_eval, size.eval_seed, on_eval, grid, out / "runs" / f"{key}.npz"
        )
        gc.collect()  # the input pipeline's reader threads of the finished run must not compete with the next
        rec.update(method=method, lr=lr, seed=seed, chosen=method != "baseline", config=config_lib.to_json(cfg))
        path.write_text(json.dumps(rec))
        runs[key] = rec
        return rec

    def publish(note: str, best_lr: float) -> dict:
        results = {
            "size": dataclasses.asdict(size),
            "best_lr": best_lr,
            "extra": list(extra),
            "note": note,
            "elapsed_s": time.perf_counter() - t_start,
            "machine": machine(),
            "targets": targets_of(runs),
            "summary": {m: summarize(runs, m) for m in ("align_overall", "fd_shapes", "vloss")},
            "runs": runs,
        }
        write_outputs(results, out)
        return results

    # 1. The baseline's LR sweep on the first seed; the best final alignment picks the LR.
    sweep = {lr: do("baseline", lr, size.seeds[0]) for lr in size.lrs}
    best_lr = max(size.lrs, key=lambda lr: (final(sweep[lr]["curve"], PRIMARY), -final(sweep[lr]["curve"], "vloss")))
    sweep[best_lr]["chosen"] = True
    log(
        f"baseline LR sweep: { ({lr: round(final(r['curve'], PRIMARY), 4) for lr, r in sweep.items()}) } -> {best_lr:g}"
    )
    publish("LR sweep done", best_lr)
    # 2. Every method on every seed, seed by seed, so slow drifts of the machine's load hit all methods alike.
    for seed in size.seeds:
        for method in ("baseline", *size.methods):
            if method == "baseline" and seed == size.seeds[0]:
                continue
            rec = do(method, best_lr, seed)
            rec["chosen"] = True
            publish(f"after {method} seed {seed}", best_lr)
    return publish("complete", best_lr)


def rescore(out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """Recomputes the caption alignment of every run of a finished benchmark in `out_dir` from the images its
    evaluations saved (`runs/<key>.npz`), with the current `alignment` reader, then rewrites the run records,
    results.json and the report: a change to the reader needs no retraining. Runs keep their LRs (the baseline's
    LR choice is not redone). FD and v-loss are kept. Images were saved as uint8, so scores can differ from
    those computed during training (on float images) by a pixel's rounding."""
    out = Path(out_dir)
    path = out / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: rescore needs a benchmark's output directory (--out of a run)")
    results = json.loads(path.read_text())
    for key, rec in results["runs"].items():
        npz = out / "runs" / f"{key}.npz"
        if not npz.exists():
            raise FileNotFoundError(f"{npz} not found: run {key} kept no images, so it cannot be rescored")
        ds = pipeline.dataset_from_config(config_lib.from_json(rec["config"]).data)
        with np.load(npz) as saved:
            scenes = [ds.scene(int(i)) for i in saved["index"]]
            for point in rec["curve"]:
                point.update(alignment.score(saved[f"step_{point['step']}"], scenes))
        (out / "runs" / f"{key}.json").write_text(json.dumps(rec))
        log(f"[{key}] rescored: final align {final(rec['curve'], PRIMARY):.3f}")
    results["targets"] = targets_of(results["runs"])
    results["summary"] = {m: summarize(results["runs"], m) for m in ("align_overall", "fd_shapes", "vloss")}
    results["note"] = f"{results.get('note', '')}; alignment rescored from saved images".lstrip("; ")
    write_outputs(results, out)
    return results

"""The speedup benchmark: the recipe and each single technique against a DiT baseline, in steps, samples, FLOPs
and wall clock to first reach the baseline's final quality (docs/speedup.md).

Protocol. A size is a config file (configs/speedup/<size>.py) holding its PROTOCOL and `get_config(method)`. The
baseline trains to its budget with a cosine learning rate decayed to 0, once per learning rate of a small sweep;
the LR with the best final alignment wins, and the baseline's final alignment (mean over seeds) is the target.
Then the full recipe and every ablation (baseline + one technique) train with the same budget, schedule and LR.
Every run evaluates its EMA weights every `eval_every` steps (`quality.Evaluator`: fixed captions, noise, sampler,
steps and guidance) and records, at each evaluation, the step, the samples and executed FLOPs so far, and the
training wall clock and process CPU time so far: the train clock stops (after `block_until_ready`) while
evaluating, sampling and writing checkpoints, and compilation is timed apart. Steps to target = the first evaluated
step whose metric reaches the target and holds it at the next evaluation (`SUSTAIN`; no interpolation: an upper
bound, `eval_every` steps coarse); "not reached" when none does.

Every run is a trainer run (`trainer.run`) with an evaluation hook (eval/hook.py) in its own workdir under
`<out>/runs/<key>/`: it checkpoints at each evaluation, so a killed benchmark resumes where it stopped. Finished
runs are stored as JSON under `<out>/runs/` and reused when the benchmark is started again with the same settings.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from reve_jax import config as config_lib
from reve_jax import flops
from reve_jax.data import pipeline
from reve_jax.eval import alignment, features, hook
from reve_jax.eval.report import write_outputs

PRIMARY = "align_overall"
# Metric -> True when higher is better.
DIRECTION = {"align_overall": True, "align_exact": True, "fd_shapes": False, "fd_dinov2": False, "vloss": False}
# A crossing must hold for this many consecutive evaluations: early, half-formed samples can pass a few checks
# by luck, and a single evaluation of ~100 images is noisy.
SUSTAIN = 2


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A benchmark size's protocol; the run configs come from the same config file (`get_config(method)`).

    name: the size's name; config: the config file (configs/speedup/<name>.py); steps: training steps of every
    run; eval_every: evaluation cadence; n_eval: held-out captions per evaluation; lrs: the baseline's LR sweep;
    seeds: training seeds; methods: what runs against the baseline; eval_seed: the evaluation noise seed."""

    name: str
    steps: int
    eval_every: int
    n_eval: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    methods: tuple[str, ...] = ("recipe", "jit", "bottleneck", "tread", "muon")
    eval_seed: int = 4321
    config: str = ""


def load_protocol(path: str | Path) -> Protocol:
    """The PROTOCOL of a speedup config file (configs/speedup/<size>.py), with its path recorded."""
    module = config_lib.load_module(str(path))
    if not isinstance(getattr(module, "PROTOCOL", None), Protocol):
        raise config_lib.ConfigError(f"{path} defines no PROTOCOL = speedup.Protocol(...): not a speedup size file")
    return dataclasses.replace(module.PROTOCOL, config=str(path))


def machine() -> dict:
    """Where the benchmark ran: host, CPU count, JAX devices and the load average (other users' work counts)."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "loadavg": list(os.getloadavg()),
    }


def build_config(size: Protocol, method: str, lr: float, seed: int, extra: tuple[str, ...] = ()):
    """The config of one run: the size file's config for `method` (its model, data and schedule), then the
    protocol's budget and checkpoint cadence (a checkpoint at every evaluation), the LR, the seed and `extra`."""
    items = [f"train.steps={size.steps}", f"train.ckpt_every={size.eval_every}", f"optim.lr={lr!r}", f"seed={seed}"]
    return config_lib.load_config(f"{size.config}:{method}", [*items, *extra])


def train_run(cfg, workdir: str | Path, eval_every: int, n_eval: int, eval_seed: int, evaluator_kwargs=None,
              on_eval=None) -> dict:  # fmt: skip
    """Trains `cfg` in `workdir` with the trainer (resuming what a killed benchmark left there), evaluating the EMA
    weights every `eval_every` steps and at the end (eval/hook.py).

    Returns a JSON-able record: {"curve": [{"step", "samples", "flops", "wall_s", "cpu_s", <metrics>}, ...],
    "compile_s", "step_flops", "diverged" (step or None)}. wall_s and cpu_s are training time only (cumulative),
    measured with the step's outputs ready."""
    from reve_jax import trainer

    ev = hook.EvalHook(workdir, eval_every, n_eval, eval_seed, evaluator_kwargs, on_eval)
    diverged = None
    try:
        summary = trainer.run(cfg, workdir, extra_hooks=[ev])
        compile_s = summary["compile_s"]
    except trainer.NonFiniteError as e:
        diverged, compile_s = e.step, None
    curve = [p for p in hook.read_points(Path(workdir) / "eval.jsonl") if not p.get("diverged")]
    if diverged is None:
        diverged = next((p["step"] for p in hook.read_points(Path(workdir) / "eval.jsonl") if p.get("diverged")), None)
    return {
        "curve": curve,
        "compile_s": compile_s,
        "step_flops": flops.train_flops_per_image(cfg) * cfg.train.global_batch,
        "diverged": diverged,
    }


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


def _run_key(size: Protocol, method: str, lr: float, seed: int, extra) -> str:
    tag = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
    return f"{size.name}-{method}-lr{lr:g}-s{seed}" + (f"-{tag}" if tag else "")


def run_benchmark(
    size: Protocol,
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
    if not size.config:
        raise ValueError("the protocol has no config file: load it with speedup.load_protocol(path)")
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
        workdir = out / "runs" / key
        if workdir.exists() and (workdir / "config.json").exists():
            if (workdir / "config.json").read_text() != config_lib.to_json(cfg):
                raise RuntimeError(f"{workdir} holds a run of another config: move it away or use another --out")
            log(f"[{key}] resuming the run in {workdir}")
        log(f"[{key}] training {size.steps} steps ({flops.train_flops_per_image(cfg) / 1e6:.1f} MFLOP per image)")

        def on_eval(p):
            if p.get("diverged"):
                log(f"[{key}] step {p['step']:5d}  diverged (loss {p['train_loss']})")
                return
            log(
                f"[{key}] step {p['step']:5d}  train {p['wall_s']:7.1f}s  align {p['align_overall']:.3f}  "
                f"exact {p['align_exact']:.3f}  fd {p.get('fd_shapes', float('nan')):.3f}  vloss {p['vloss']:.4f}"
                f"  (eval {p['eval_s']:.1f}s)"
            )

        record = {"machine_start": machine()}
        record.update(train_run(cfg, workdir, size.eval_every, size.n_eval, size.eval_seed, ev_kwargs, on_eval))
        record["machine_end"] = machine()
        _pack_images(workdir, out / "runs" / f"{key}.npz", size, cfg)
        gc.collect()  # the input pipeline's reader threads of the finished run must not compete with the next
        record.update(method=method, lr=lr, seed=seed, chosen=method != "baseline", config=config_lib.to_json(cfg))
        path.write_text(json.dumps(record))
        runs[key] = record
        return record

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


def _pack_images(workdir: Path, dest: Path, size: Protocol, cfg) -> None:
    """Every evaluation's images of a run in one .npz (keys step_<n>, and the held-out `index`) for `rescore`."""
    from reve_jax.eval import vloss

    images = hook.load_images(workdir)
    index = vloss.heldout_indices(cfg.data.num_samples, size.n_eval)
    np.savez_compressed(dest, index=index, **{f"step_{k}": v for k, v in images.items()})


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

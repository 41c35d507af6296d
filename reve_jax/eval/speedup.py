"""The speedup benchmark: the JIT-DDT recipe against a latent DiT (Linum's comparison) and the other baselines, in
steps, samples, executed FLOPs, wall clock and CPU seconds to reach the baseline's final quality (docs/speedup.md).

A size is a config file (configs/speedup/<size>.py) holding its PROTOCOL, the LR and guidance scale frozen per
method by the sweep (FROZEN), and `get_config(method)`. The protocol:

- every method trains the same budget (steps of the same batch) with a cosine LR decayed to 0, on >= 3 seeds; a
  seed sets the model's initialisation, the noise and the data (data.seed), and methods are paired within a seed;
- each run is a trainer run (`trainer.run`) with the evaluation hook (eval/hook.py) in its own workdir under
  `<out>/runs/<key>/`: it checkpoints at every evaluation, so a killed benchmark resumes; its EMA weights are
  evaluated every `steps / evals` steps on `n_eval` held-out captions (fixed noise, sampler and guidance) and at
  the end on `n_final`; the train clock excludes compilation, evaluation and checkpoint writes;
- time to target (eval/target.py): the first crossing of the seed's baseline final value, interpolated between
  evaluations and sustained over two; censored at the budget (">"); the baseline's time is its full budget;
- a latent baseline's autoencoder is trained once per size (cached; its cost reported apart) and its
  reconstructions must score >= `min_recon_align` caption alignment before any run starts;
- the validity gate: a baseline whose final alignment is below `gate_final`, or that gained less than
  `gate_gain` over its first evaluation, gives "no speedup measurable" instead of ratios.

`sweep` runs the LR grid (and then the guidance scales) of each method on the first seed and says what to freeze;
`run_benchmark` runs the comparison. Finished runs are stored as JSON under `<out>/runs/` and reused.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from reve_jax import config as config_lib
from reve_jax import flops, latent, xla
from reve_jax.data import pipeline
from reve_jax.eval import alignment, hook, target
from reve_jax.eval.report import write_outputs

PRIMARY = "align_overall"


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A benchmark size's protocol (see the module docstring); the run configs come from the same file.

    steps: the budget of every run; evals: evaluations over it (every steps/evals steps); n_eval / n_final: held-out
    captions per evaluation / at the end; seeds; baseline: the method the others are timed against; methods: the
    headline comparison; further: the other methods of the size (baseline B, the PRX variant, ablations), run by
    their own command; sweep_lrs: the LR grid the sweep starts from; cfg_scales: the guidance scales it tries;
    gate_final / gate_gain: the validity gate; min_recon_align: the autoencoder's reconstruction check."""

    name: str
    steps: int
    seeds: tuple[int, ...] = (0, 1, 2)
    evals: int = 20
    n_eval: int = 256
    n_final: int = 512
    baseline: str = "latent"
    methods: tuple[str, ...] = ("recipe",)
    further: tuple[str, ...] = ()
    sweep_lrs: tuple[float, ...] = (5e-4, 1e-3, 2e-3, 4e-3)
    cfg_scales: tuple[float, ...] = (1.5, 3.0, 5.0)
    gate_final: float = 0.45
    gate_gain: float = 0.2
    min_recon_align: float = 0.98
    eval_seed: int = 4321
    config: str = ""

    @property
    def eval_every(self) -> int:
        return max(1, self.steps // self.evals)


def load_protocol(path: str | Path) -> Protocol:
    """The PROTOCOL of a speedup config file (configs/speedup/<size>.py), with its path recorded."""
    module = config_lib.load_module(str(path))
    if not isinstance(getattr(module, "PROTOCOL", None), Protocol):
        raise config_lib.ConfigError(f"{path} defines no PROTOCOL = speedup.Protocol(...): not a speedup size file")
    return dataclasses.replace(module.PROTOCOL, config=str(path))


def machine() -> dict:
    """Where the benchmark ran: host, CPU model and count, JAX devices and the load average (other users' work
    counts)."""
    return {
        "host": platform.node(),
        "cpu": xla.cpu_model(),
        "cpus": os.cpu_count(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "loadavg": list(os.getloadavg()),
    }


RATES = ("lr", "muon_lr")  # the optimizer rates a sweep can vary: the main (AdamW) group's, Muon's group's


def build_config(size: Protocol, method: str, seed: int, extra: tuple[str, ...] = (), lr: float | None = None,
                 rate: str = "lr"):  # fmt: skip
    """The config of one run: the size file's config for `method` (its model, data, frozen LR and guidance), then
    the protocol's budget and checkpoint cadence (a checkpoint at every evaluation), the seed (model and data),
    `lr` when given (the sweep) as the optimizer's `rate` (one of RATES; the other keeps its frozen value), and
    `extra` overrides."""
    if rate not in RATES:
        raise ValueError(f"unknown rate {rate!r}: a sweep varies one of {RATES}")
    items = [f"train.steps={size.steps}", f"train.ckpt_every={size.eval_every}", f"seed={seed}", f"data.seed={seed}"]
    if lr is not None:
        items.append(f"optim.{rate}={lr!r}")
    cfg = config_lib.load_config(f"{size.config}:{method}", [*items, *extra])
    if lr is not None and rate == "muon_lr" and cfg.optim.name != "muon":
        raise ValueError(f"{method} trains with {cfg.optim.name}, not Muon: sweep its rate with --rate lr")
    return cfg


def _read_keys(cfg_json: str) -> dict:
    """A config's JSON as a dict without the keys the run never read: Muon's settings (optim.muon_*) when the
    optimizer is not Muon, the sampler's clamp (sample.t_eps) when the model does not predict x."""
    d = json.loads(cfg_json)
    if d["optim"]["name"] != "muon":
        d["optim"] = {k: v for k, v in d["optim"].items() if not k.startswith("muon_")}
    if d["diffusion"]["prediction"] != "x":
        d["sample"] = {k: v for k, v in d["sample"].items() if k != "t_eps"}
    return d


def same_config(saved: str | None, cfg) -> bool:
    """Whether a finished run's saved config (JSON) is `cfg`'s; keys added to the config since it ran are read at
    the value it ran under (config.ADDED_KEYS), so a new option does not invalidate finished runs, and keys the run
    never read do not count (`_read_keys`: an AdamW run does not depend on Muon's rate)."""
    if saved is None:
        return False
    return _read_keys(config_lib.to_json(config_lib.from_json(saved))) == _read_keys(config_lib.to_json(cfg))


def with_autoencoder(cfg, size: Protocol, cache_dir: Path, log: Callable[[str], None] = print):
    """A latent run's config with latent.path set to the size's cached autoencoder (trained and checked on first
    use); pixel runs unchanged. Returns (config, the autoencoder's training record or None). Raises RuntimeError
    when the reconstructions fail the check: a latent baseline must not lose to its own autoencoder."""
    if not cfg.latent.path:
        return cfg, None
    path, info = latent.cached(cfg, cache_dir)
    check = info.get("check", {})
    nan = float("nan")
    log(
        f"autoencoder {path.name}: trained in {info.get('train_s', nan):.0f}s, reconstructions align "
        f"{check.get('align_recon', nan):.3f} (real images {check.get('align_real', nan):.3f})"
    )
    if check.get("align_recon", 0.0) < size.min_recon_align:
        raise RuntimeError(
            f"the autoencoder's reconstructions score {check.get('align_recon')} caption alignment, below "
            f"{size.min_recon_align}: train it longer or wider (latent.train_steps, latent.width) before benchmarking"
        )
    config_lib.apply_override(cfg, f"latent.path='{path}'")
    return cfg, info


def executed_step_flops(cfg) -> float:
    """FLOPs of one train step of `cfg` as XLA counts them in the lowered step: every operation it executes, the
    model's and the optimizer's (Muon's Newton-Schulz iterations) and the frozen networks' (baseline A's encoder,
    REPA's target network). The benchmark's FLOP cost is this count, not `flops.train_flops_per_image` (the model's
    matmuls, the convention of MFU), which misses whatever a method adds beside the model: at the CPU size the PRX
    variant executes 330 MFLOP per image where its model's matmuls count 164 (docs/speedup.md)."""
    from reve_jax import builder

    count = builder.lowered_flops(builder.build(cfg).lower())
    if not math.isfinite(count):
        raise RuntimeError(f"XLA gives no FLOP count for the train step of {cfg.name} on {jax.default_backend()}")
    return count


def count_flops(rec: dict, step_flops: float) -> dict:
    """`rec` (a run record) with its FLOP cost at `step_flops` per step: every evaluation's cumulative "flops" is
    its step times that (a benchmark run trains one image shape, so every step costs the same)."""
    for point in rec["curve"]:
        point["flops"] = point["step"] * step_flops
    rec["step_flops"] = step_flops
    return rec


def train_run(cfg, workdir: str | Path, eval_every: int, n_eval: int, eval_seed: int, evaluator_kwargs=None,
              on_eval=None, n_final: int | None = None) -> dict:  # fmt: skip
    """Trains `cfg` in `workdir` with the trainer (resuming what a killed benchmark left there), evaluating the EMA
    weights every `eval_every` steps and at the end (eval/hook.py; the last evaluation also on `n_final` captions).

    Returns a JSON-able record: {"curve": [{"step", "samples", "flops", "wall_s", "cpu_s", <metrics>}, ...],
    "compile_s", "step_flops" (executed, `executed_step_flops`), "model_step_flops" (the model's matmuls),
    "diverged" (step or None)}. wall_s and cpu_s are training time only (cumulative), measured with the step's
    outputs ready."""
    from reve_jax import trainer

    ev = hook.EvalHook(workdir, eval_every, n_eval, eval_seed, evaluator_kwargs, on_eval, n_final=n_final)
    diverged, step_flops = None, float("nan")
    try:
        summary = trainer.run(cfg, workdir, extra_hooks=[ev])
        if summary["reason"] not in ("finished", "diverged"):  # a signal: the run's checkpoint resumes it
            raise RunStopped(
                f"{workdir}: stopped at step {summary['step']} of {cfg.train.steps} ({summary['reason']}); run the "
                "same benchmark command again to resume it from its checkpoint"
            )
        compile_s = summary["compile_s"]
        counts = list(summary["step_flops_executed"].values())
        step_flops = counts[0] if len(counts) == 1 else step_flops  # the trainer's own count of the one shape
    except trainer.NonFiniteError as e:
        diverged, compile_s = e.step, None
    points = hook.read_points(Path(workdir) / "eval.jsonl")
    curve = [p for p in points if not p.get("diverged")]
    if diverged is None:
        diverged = next((p["step"] for p in points if p.get("diverged")), None)
    record = {
        "curve": curve,
        "compile_s": compile_s,
        "model_step_flops": flops.train_flops_per_image(cfg) * cfg.train.global_batch,
        "diverged": diverged,
    }
    return count_flops(record, step_flops if math.isfinite(step_flops) else executed_step_flops(cfg))


class RunStopped(RuntimeError):
    """A benchmark run stopped before its budget (a signal): no record is written, a rerun resumes it."""


def complete(rec: dict, steps: int) -> bool:
    """Whether a saved run record covers its budget: it diverged or its curve reaches `steps` (a record with a
    shorter curve came from a stopped run, written so by versions before RunStopped, and is trained on)."""
    return bool(rec.get("diverged")) or bool(rec.get("curve")) and rec["curve"][-1]["step"] >= steps


def _run_key(size: Protocol, method: str, seed: int, extra, lr: float | None = None, rate: str = "lr") -> str:
    tag = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
    lr_tag = f"-{rate.replace('_', '')}{lr:g}" if lr is not None else ""
    return f"{size.name}-{method}{lr_tag}-s{seed}" + (f"-{tag}" if tag else "")


class Runner:
    """Runs (or reuses) benchmark runs into `<out>/runs/`."""

    def __init__(self, size: Protocol, out: Path, extra=(), cache_dir=None, evaluator_kwargs=None, log=print):
        self.size, self.out, self.extra, self.log = size, Path(out), tuple(extra), log
        self.cache_dir = Path(cache_dir) if cache_dir else self.out / "cache"
        self.ev_kwargs = {"cache_dir": self.cache_dir, **(evaluator_kwargs or {})}
        self.autoencoders: dict[str, dict] = {}
        (self.out / "runs").mkdir(parents=True, exist_ok=True)

    def run(self, method: str, seed: int, lr: float | None = None, *, evals: int | None = None,
            rate: str = "lr") -> dict:  # fmt: skip
        size = self.size if evals is None else dataclasses.replace(self.size, evals=evals)
        key = _run_key(size, method, seed, self.extra, lr, rate) + ("" if evals is None else f"-e{evals}")
        path = self.out / "runs" / f"{key}.json"
        cfg = build_config(size, method, seed, self.extra, lr, rate)
        cfg, ae = with_autoencoder(cfg, size, self.cache_dir, self.log)
        if ae is not None:
            self.autoencoders[cfg.latent.path] = ae
        if path.exists():
            rec = json.loads(path.read_text())
            if same_config(rec.get("config"), cfg) and complete(rec, size.steps):
                self.log(f"[{key}] reused from {path}")
                return rec
        workdir = self.out / "runs" / key
        if (workdir / "config.json").exists() and not same_config((workdir / "config.json").read_text(), cfg):
            raise RuntimeError(f"{workdir} holds a run of another config: move it away or use another --out")
        muon = f", muon lr {cfg.optim.muon_lr or cfg.optim.lr:g}" if cfg.optim.name == "muon" else ""
        self.log(f"[{key}] {size.steps} steps, lr {cfg.optim.lr:g}{muon}, cfg {cfg.sample.cfg_scale:g}, "
                 f"{flops.train_flops_per_image(cfg) / 1e6:.1f} MFLOP per image")  # fmt: skip

        def on_eval(p):
            if p.get("diverged"):
                self.log(f"[{key}] step {p['step']:5d}  diverged (loss {p['train_loss']})")
                return
            self.log(
                f"[{key}] step {p['step']:5d}  train {p['wall_s']:7.1f}s  align {p['align_overall']:.3f}  "
                f"exact {p['align_exact']:.3f}  kid {p.get('kid', float('nan')):.4f}  (eval {p['eval_s']:.1f}s)"
            )

        record = {"machine_start": machine()}
        record.update(
            train_run(cfg, workdir, size.eval_every, size.n_eval, size.eval_seed, self.ev_kwargs, on_eval,
                      n_final=size.n_final)
        )  # fmt: skip
        record["machine_end"] = machine()
        _pack_images(workdir, self.out / "runs" / f"{key}.npz", size, cfg)
        gc.collect()  # the input pipeline's reader threads of the finished run must not compete with the next
        record.update(method=method, seed=seed, lr=cfg.optim.lr, muon_lr=cfg.optim.muon_lr,
                      cfg_scale=cfg.sample.cfg_scale, config=config_lib.to_json(cfg))  # fmt: skip
        path.write_text(json.dumps(record))
        return record


def _pack_images(workdir: Path, dest: Path, size: Protocol, cfg) -> None:
    """Every evaluation's images of a run in one .npz (keys step_<n>, and the held-out `index`) for `rescore`."""
    from reve_jax.eval import vloss

    images = hook.load_images(workdir)
    index = vloss.heldout_indices(cfg.data.num_samples, size.n_eval)
    np.savez_compressed(dest, index=index, **{f"step_{k}": v for k, v in images.items()})


def summarize(size: Protocol, runs: list[dict]) -> dict:
    """The analysis of a comparison: the gate, paired speedups per metric, finals with intervals."""
    ok, why = target.gate(runs, size.baseline, PRIMARY, size.gate_final, size.gate_gain)
    metrics = ("align_overall", "align_exact", "kid", "final_align_overall", "final_kid", "vloss")
    return {
        "gate": {"ok": ok, "why": why},
        "paired": {m: target.paired(runs, size.baseline, m) for m in ("align_overall", "kid") if _has(runs, m)},
        "finals": target.finals(runs, tuple(m for m in metrics if _has(runs, m))),
    }


def _has(runs, metric) -> bool:
    return bool(runs) and all(r["curve"] and metric in r["curve"][-1] for r in runs)


def run_benchmark(size: Protocol, out_dir, *, methods=None, extra=(), cache_dir=None, evaluator_kwargs=None,
                  log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Runs the baseline and `methods` (default: the size's headline methods) on every seed, seed by seed so slow
    drifts of the machine's load hit all methods alike, into `out_dir` (runs/, results.json, speedup.md,
    speedup.png), reusing finished runs. Returns the results dict."""
    if not size.config:
        raise ValueError("the protocol has no config file: load it with speedup.load_protocol(path)")
    out = Path(out_dir)
    runner = Runner(size, out, extra, cache_dir, evaluator_kwargs, log)
    methods = tuple(methods or size.methods)
    t_start = time.perf_counter()
    runs: list[dict] = []

    def publish(note: str) -> dict:
        results = {
            "size": dataclasses.asdict(size),
            "methods": [size.baseline, *methods],
            "extra": list(extra),
            "note": note,
            "elapsed_s": time.perf_counter() - t_start,
            "machine": machine(),
            "autoencoders": runner.autoencoders,
            "summary": summarize(size, runs),
            "runs": runs,
        }
        write_outputs(results, out)
        return results

    for seed in size.seeds:
        for method in (size.baseline, *(m for m in methods if m != size.baseline)):
            runs.append(runner.run(method, seed))
            publish(f"after {method} seed {seed}")
    return publish("complete")


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
    log: Callable[[str], None] = print,
) -> dict:
    """For each method, on `seeds` (default: the size's first): the LR grid (each run evaluated at the end only;
    a rate's score is its mean over the seeds), extended by factors of 2 while the best LR sits at an edge (at most
    `max_extend` times), then the guidance scales on the winner's final EMA weights (mean over the seeds). Two seeds
    choose a rate that holds on both where one seed may pick a rate at the edge of stability. `rate` is the
    optimizer rate the grid varies (RATES: "muon_lr" sweeps Muon's group with the main group at its frozen rate).
    Writes <out>/sweep.json ({method: ...}, or {method@muon_lr: ...}) and returns {method: {rate: best,
    "cfg_scale", "grid": {lr: mean align}, "per_seed": {seed: {lr: align}}, ...}}."""
    out = Path(out_dir)
    runner = Runner(size, out, extra, cache_dir, evaluator_kwargs, log)
    seeds = tuple(seeds or size.seeds[:1])
    result = {}
    for method in methods:
        frozen = build_config(size, method, seeds[0], extra)  # the incumbent rate and scale win exact ties
        per_seed: dict[int, dict[float, float]] = {seed: {} for seed in seeds}
        grid = sorted(size.sweep_lrs)
        for _ in range(max_extend + 1):
            for lr in grid:
                for seed in seeds:
                    if lr not in per_seed[seed]:
                        rec = runner.run(method, seed, lr, evals=1, rate=rate)
                        per_seed[seed][lr] = rec["curve"][-1][PRIMARY] if rec["curve"] else float("-inf")
            scores = {lr: float(np.mean([per_seed[seed][lr] for seed in seeds])) for lr in per_seed[seeds[0]]}
            best = pick(scores, getattr(frozen.optim, rate))
            lrs = sorted(scores)
            if best == lrs[0]:
                grid = [best / 2]
            elif best == lrs[-1]:
                grid = [best * 2]
            else:
                break
        inside = lrs[0] < best < lrs[-1]
        keys = [_run_key(size, method, seed, extra, best, rate) + "-e1" for seed in seeds]
        by_seed = [guidance_scores(out / "runs" / key, size) for key in keys]
        scales = {k: float(np.mean([g[k] for g in by_seed])) for k in by_seed[0]}
        r = result[method] = {rate: best, "inside_grid": inside, "grid": _by_rate(scores), "seeds": list(seeds),
                              "per_seed": {seed: _by_rate(d) for seed, d in per_seed.items()},
                              "cfg_scale": float(pick(scales, f"{frozen.sample.cfg_scale:g}")),
                              "cfg_scores": scales}  # fmt: skip
        log(f"sweep {method}: {rate} {best:g} ({'inside' if inside else 'AT THE EDGE of'} the grid {r['grid']}, "
            f"seeds {list(seeds)}), guidance {r['cfg_scale']:g} ({scales})")  # fmt: skip
        path = out / "sweep.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved.update({(m if rate == "lr" else f"{m}@{rate}"): r for m, r in result.items()})
        path.write_text(json.dumps(saved, indent=1))
    return result


def pick(scores: dict, incumbent):
    """The key of the highest score; on an exact tie the incumbent (the size's frozen value) when it is among the
    tied, else the first tied key in `scores`' order: a sweep that cannot tell two settings apart keeps what is
    frozen rather than moving on the order of a list."""
    top = max(scores.values())
    tied = [k for k, v in scores.items() if v == top]
    return incumbent if incumbent in tied else tied[0]


def _by_rate(scores: dict[float, float]) -> dict[str, float]:
    """{rate: score} with the rates as JSON keys ('0.002'), in increasing order."""
    return {f"{k:g}": v for k, v in sorted(scores.items())}


def guidance_scores(workdir: Path, size: Protocol) -> dict[str, float]:
    """Caption alignment of a finished run's final EMA weights at each of the size's guidance scales (n_eval
    captions, the evaluation seed)."""
    from reve_jax.eval import quality, scoring

    cfg, graphdef, ema, _, mesh = scoring.restore_ema(workdir)
    out = {}
    for scale in size.cfg_scales:
        c = config_lib.from_json(config_lib.to_json(cfg))
        config_lib.apply_override(c, f"sample.cfg_scale={scale!r}")
        ev = quality.Evaluator(c, graphdef, size.n_eval, size.eval_seed, feature_spec=None, mesh=mesh)
        out[f"{scale:g}"] = ev(ema)[PRIMARY]
    return out


def rescore(out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """Recomputes the caption alignment of every run of a finished benchmark in `out_dir` from the images its
    evaluations saved (`runs/<key>.npz`), with the current `alignment` reader, and its FLOP cost with the current
    count (`executed_step_flops`), then rewrites the run records, results.json and the report: a change to the
    reader or the count needs no retraining. Other metrics are kept. Images were saved as uint8, so scores can
    differ from those computed during training by a pixel's rounding."""
    out = Path(out_dir)
    path = out / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: rescore needs a benchmark's output directory (--out of a run)")
    results = json.loads(path.read_text())
    size = Protocol(**{k: tuple(v) if isinstance(v, list) else v for k, v in results["size"].items()})
    step_flops: dict[str, float] = {}  # per method: its runs differ only in the seed, which costs no FLOPs
    for rec in results["runs"]:
        key = _run_key(size, rec["method"], rec["seed"], tuple(results.get("extra", ())))
        npz = out / "runs" / f"{key}.npz"
        if not npz.exists():
            raise FileNotFoundError(f"{npz} not found: run {key} kept no images, so it cannot be rescored")
        cfg = config_lib.from_json(rec["config"])
        rec.setdefault("model_step_flops", flops.train_flops_per_image(cfg) * cfg.train.global_batch)
        if rec["method"] not in step_flops:
            step_flops[rec["method"]] = executed_step_flops(cfg)
        count_flops(rec, step_flops[rec["method"]])
        ds = pipeline.dataset_from_config(cfg.data)
        with np.load(npz) as saved:
            scenes = [ds.scene(int(i)) for i in saved["index"]]
            for point in rec["curve"]:
                point.update(alignment.score(saved[f"step_{point['step']}"], scenes))
        (out / "runs" / f"{key}.json").write_text(json.dumps(rec))
        log(f"[{key}] rescored: final align {rec['curve'][-1][PRIMARY]:.3f}, {rec['step_flops'] / 1e9:.1f} GFLOP "
            f"per step (the model's matmuls {rec['model_step_flops'] / 1e9:.1f})")  # fmt: skip
    results["summary"] = summarize(size, results["runs"])
    results["note"] = f"{results.get('note', '')}; alignment rescored from saved images, FLOPs recounted".lstrip("; ")
    write_outputs(results, out)
    return results

"""Running the benchmark: one trainer run per (method, seed) with the evaluation hook, reused when finished;
the comparison and its report; rescoring a finished benchmark."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from reve_jax import config as config_lib
from reve_jax import flops
from reve_jax.data import pipeline
from reve_jax.data.synthetic import alignment
from reve_jax.latent import training as latent_training
from reve_jax.metrics import hook
from reve_jax.speedup import analysis
from reve_jax.speedup.protocol import FACTORS, PRIMARY, Protocol, build_config, machine, same_config
from reve_jax.speedup.report import write_outputs


def with_autoencoder(cfg, size: Protocol, cache_dir: Path, log: Callable[[str], None] = print):
    """A latent run's config with latent.path set to the size's cached autoencoder (trained and checked on first
    use); pixel runs unchanged. Returns (config, the autoencoder's training record or None). Raises RuntimeError
    when the reconstructions fail the check: a latent baseline must not lose to its own autoencoder."""
    if not cfg.latent.path:
        return cfg, None
    path, info = latent_training.cached(cfg, cache_dir)
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
    from reve_jax.train import builder

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
              on_eval=None, n_final: int | None = None, split: str | None = None) -> dict:  # fmt: skip
    """Trains `cfg` in `workdir` with the trainer (resuming what a killed benchmark left there), evaluating the EMA
    weights every `eval_every` steps and at the end (metrics/hook.py; the last evaluation also on `n_final` captions).

    Returns a JSON-able record: {"curve": [{"step", "samples", "flops", "wall_s", "cpu_s", <metrics>}, ...],
    "compile_s", "step_flops" (executed, `executed_step_flops`), "model_step_flops" (the model's matmuls),
    "diverged" (step or None)}. wall_s and cpu_s are training time only (cumulative), measured with the step's
    outputs ready."""
    from reve_jax.train import trainer

    ev = hook.EvalHook(workdir, eval_every, n_eval, eval_seed, evaluator_kwargs, on_eval, n_final=n_final,
                       split=split)  # fmt: skip
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


class RunConflict(RuntimeError):
    """A run's name is taken by a run of another config (its workdir, or its record in the archive): training it
    would overwrite what was saved."""


def complete(rec: dict, steps: int) -> bool:
    """Whether a saved run record covers its budget: it diverged or its curve reaches `steps` (a record with a
    shorter curve came from a stopped run, written so by versions before RunStopped, and is trained on)."""
    return bool(rec.get("diverged")) or bool(rec.get("curve")) and rec["curve"][-1]["step"] >= steps


def _run_key(size: Protocol, method: str, seed: int, extra, lr: float | None = None, rate: str = "lr") -> str:
    tag = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
    lr_tag = f"-{rate.replace('_', '')}{lr:g}" if lr is not None else ""
    return f"{size.name}-{method}{lr_tag}-s{seed}" + (f"-{tag}" if tag else "")


class Runner:
    """Runs (or reuses) benchmark runs into `<out>/runs/`. `archive`: a directory of finished runs' records (their
    JSON, no weights or images) and of the autoencoder they used, kept apart from `out`, e.g. committed to the
    repository: a run found there is reused (and its autoencoder not trained), every run finished here is copied
    there, so a study spread over machines and sessions resumes where the archive stands."""

    def __init__(self, size: Protocol, out: Path, extra=(), cache_dir=None, evaluator_kwargs=None, log=print,
                 archive=None):  # fmt: skip
        self.size, self.out, self.extra, self.log = size, Path(out), tuple(extra), log
        self.cache_dir = Path(cache_dir) if cache_dir else self.out / "cache"
        self.archive = Path(archive) if archive else None
        self.ev_kwargs = {"cache_dir": self.cache_dir, **(evaluator_kwargs or {})}
        self.autoencoders: dict[str, dict] = {}
        self.invocation = f"{platform.node()}-{os.getpid()}-{time.time():.0f}"  # runs trained by this Runner
        (self.out / "runs").mkdir(parents=True, exist_ok=True)

    def _finished(self, key: str, cfg, size: Protocol, tuning: bool) -> dict | None:
        """The finished record of run `key` with `cfg`, from <out>/runs or the archive (copied to <out>/runs), or
        None. A sweep's run counts as finished once it has its guidance scores (older records get them here from
        their weights when these are still in <out>/runs); it is reused whatever the guidance scale frozen since,
        when its scores hold that scale (the sweep reads its score at that scale: sweep_score)."""
        for path in (self.out / "runs" / f"{key}.json", *([self.archive / f"{key}.json"] if self.archive else [])):
            if not path.exists():
                continue
            rec = json.loads(path.read_text())
            scales = rec.get("cfg_scores", {}) if tuning else {}  # a sweep's record, scored at every scale
            same = same_config(rec.get("config"), cfg, any_guidance=f"{cfg.sample.cfg_scale:g}" in scales)
            if not (same and complete(rec, size.steps)):
                continue
            scored = tuning and "cfg_scores" not in rec
            if scored:
                if not (self.out / "runs" / key / "checkpoints").is_dir():
                    continue
                rec["cfg_scores"] = guidance_scores(self.out / "runs" / key, size, rec)
            return self._reuse(key, cfg, rec, f"reused from {path}", only_missing=not scored)
        return self._twin(key, cfg, size, tuning)

    def _reuse(self, key: str, cfg, rec: dict, note: str, only_missing: bool = True) -> dict:
        """A finished record as run `key`'s: saved under `key` (`only_missing`: where it is not yet), its
        autoencoder's one-time cost kept to report beside the runs that used it."""
        self._save(key, rec, only_missing=only_missing)
        if rec.get("autoencoder") is not None:
            self.autoencoders.setdefault(cfg.latent.path, rec["autoencoder"])
        self.log(f"[{key}] {note}")
        return dict(rec, reused=rec.get("invocation") != self.invocation)

    def _twin(self, key: str, cfg, size: Protocol, tuning: bool) -> dict | None:
        """A finished run of the same config under another name, reused (and saved under `key`) instead of
        training it again: a Muon arm's grid of Muon's rate, with AdamW's pinned at its winner, passes through the
        point its AdamW sweep already ran (Muon at its frozen rate there), and training is deterministic. Only a
        run of the same kind counts: a sweep's (evaluated once, its guidance scores) for a sweep's, a headline's
        (its evaluations) for a headline's."""
        sweep_run = key.endswith("-e1")
        dirs = [self.out / "runs", *([self.archive] if self.archive else [])]
        for path in sorted({p for d in dirs if d.is_dir() for p in d.glob(f"{size.name}-*.json")}):
            if path.stem == key or path.stem.endswith("-e1") != sweep_run:
                continue
            rec = json.loads(path.read_text())
            scales = rec.get("cfg_scores", {})
            if tuning != bool(scales) or not complete(rec, size.steps):
                continue
            if same_config(rec.get("config"), cfg, any_guidance=f"{cfg.sample.cfg_scale:g}" in scales):
                return self._reuse(key, cfg, rec, f"reused from {path}: the same config")
        return None

    def _check_archive(self, key: str, cfg) -> None:
        """Refuses, before any training, a run whose name the archive holds for another config (a size file
        changed since, e.g. its data; a sweep record is refused too when its scores lack the guidance scale frozen
        since): its record would be overwritten when the run finishes."""
        path = self.archive / f"{key}.json" if self.archive else None
        if path is not None and path.exists() and not same_config(json.loads(path.read_text()).get("config"), cfg):
            raise RunConflict(
                f"{path} is the record of run {key} under another config (has the size file changed?); finishing "
                "this run would overwrite it: pass another --archive directory for the new config"
            )

    def _share_autoencoder(self, cfg, into_cache: bool) -> None:
        """The archive keeps the autoencoder its records used (its file, a few hundred KB, named by the hash of its
        settings): `into_cache`, one missing from the cache directory is copied there from the archive instead of
        trained again (on another CPU it would come out slightly different); else one the archive lacks is copied
        there from the cache. A training stopped before its end leaves its partial state in the cache
        (`latent_training.partial_path`); copied by hand into the archive, it is taken into a cache that has neither
        file, so a new machine resumes the training instead of starting it again."""
        if not (self.archive and cfg.latent.path):
            return
        cached = latent_training.cache_path(cfg, self.cache_dir)
        pairs = [(self.archive / cached.name, cached) if into_cache else (cached, self.archive / cached.name)]
        partial = latent_training.partial_path(cached)
        if into_cache and not (cached.exists() or (self.archive / cached.name).exists()):
            pairs.append((self.archive / partial.name, partial))
        for src, dst in pairs:
            if src.exists() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(dst.name + ".tmp")
                shutil.copyfile(src, tmp)
                tmp.replace(dst)

    def _save(self, key: str, rec: dict, only_missing: bool = False) -> None:
        """Writes the record to <out>/runs and the archive (`only_missing`: where it is not yet)."""
        text = json.dumps(rec)
        for d in (self.out / "runs", self.archive):
            if d is not None and not (only_missing and (d / f"{key}.json").exists()):
                d.mkdir(parents=True, exist_ok=True)
                tmp = d / f"{key}.json.tmp"
                tmp.write_text(text)
                tmp.replace(d / f"{key}.json")

    def run(self, method: str, seed: int, lr: float | None = None, *, evals: int | None = None,
            rate: str = "lr", tuning: bool = False) -> dict:  # fmt: skip
        """One run (reused when a finished record of the same config exists). `tuning`: a sweep's run, evaluated
        with the size's tuning noise seed (tune_eval_seed) instead of the headline's, and its final weights scored
        at each of the size's guidance scales (the record's "cfg_scores")."""
        size = self.size if evals is None else dataclasses.replace(self.size, evals=evals)
        key = _run_key(size, method, seed, self.extra, lr, rate) + ("" if evals is None else f"-e{evals}")
        # from the size's own evaluations, so a sweep run (evaluated at the end only) checkpoints at the headline's
        # cadence too: a stopped session loses minutes, not the run
        cfg = build_config(self.size, method, seed, self.extra, lr, rate)
        if cfg.latent.path:  # where the size's autoencoder is (or will be): part of the config a record matches
            config_lib.apply_override(cfg, f"latent.path='{latent_training.cache_path(cfg, self.cache_dir)}'")
        found = self._finished(key, cfg, size, tuning)
        if found is not None:
            return found
        self._check_archive(key, cfg)
        self._share_autoencoder(cfg, into_cache=True)
        cfg, ae = with_autoencoder(cfg, size, self.cache_dir, self.log)
        self._share_autoencoder(cfg, into_cache=False)
        if ae is not None:
            self.autoencoders[cfg.latent.path] = ae
        workdir = self.out / "runs" / key
        if (workdir / "config.json").exists() and not same_config((workdir / "config.json").read_text(), cfg):
            raise RunConflict(f"{workdir} holds a run of another config: move it away or use another --out")
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
            train_run(cfg, workdir, size.eval_every, size.n_eval, size.tune_eval_seed if tuning else size.eval_seed,
                      self.ev_kwargs, on_eval, n_final=size.n_final, split=size.split)
        )  # fmt: skip
        record["machine_end"] = machine()
        _pack_images(workdir, self.out / "runs" / f"{key}.npz", size, cfg)
        gc.collect()  # the input pipeline's reader threads of the finished run must not compete with the next
        record.update(method=method, seed=seed, lr=cfg.optim.lr, muon_lr=cfg.optim.muon_lr,
                      cfg_scale=cfg.sample.cfg_scale, config=config_lib.to_json(cfg),
                      invocation=self.invocation, autoencoder=ae)  # fmt: skip
        if tuning:
            record["cfg_scores"] = guidance_scores(workdir, size, record)
        self._save(key, record)
        return dict(record, reused=False)


def guidance_scores(workdir: Path, size: Protocol, record: dict) -> dict[str, float]:
    """Caption alignment of a finished run's final EMA weights at each of the size's guidance scales (n_eval
    captions, the tuning noise seed); {} for a run that diverged (a sweep never picks it)."""
    if record.get("diverged"):
        return {}
    from reve_jax.metrics import quality
    from reve_jax.train import sampling

    r = sampling.restore_for_sampling(workdir)
    cfg, graphdef, ema, mesh = r.cfg, r.graphdef, r.params, r.mesh
    out = {}
    for scale in size.cfg_scales:
        c = config_lib.from_json(config_lib.to_json(cfg))
        config_lib.apply_override(c, f"sample.cfg_scale={scale!r}")
        ev = quality.Evaluator(c, graphdef, size.n_eval, size.tune_eval_seed, feature_spec=None, mesh=mesh,
                               split=size.split)  # fmt: skip
        out[f"{scale:g}"] = ev(ema)[PRIMARY]
    return out


def _pack_images(workdir: Path, dest: Path, size: Protocol, cfg) -> None:
    """Every evaluation's images of a run in one .npz (keys step_<n>, the evaluation split's `index` and `split`)
    for `rescore`."""
    images = hook.load_images(workdir)
    split = hook.read_points(Path(workdir) / "eval.jsonl")[-1].get("split", "seen")
    index = np.arange(size.n_eval, dtype=np.int64)
    np.savez_compressed(dest, index=index, split=split, **{f"step_{k}": v for k, v in images.items()})


def summarize(size: Protocol, runs: list[dict]) -> dict:
    """The analysis of a comparison (analysis.py): the per-seed gate, the time to the baseline's plateau on the
    primary metric with intervals over seeds and captions, and every method's final values."""
    metrics = ("align_overall", "align_exact", "kid", "vloss")
    return {
        "time_to_target": analysis.analyze(
            runs,
            size.baseline,
            PRIMARY,
            size.steps,
            factors=FACTORS,
            gate_final=size.gate_final,
            gate_gain=size.gate_gain,
        ),
        "finals": analysis.finals(runs, tuple(m for m in metrics if _has(runs, m))),
    }


def one_time_costs(runner: Runner, methods) -> dict:
    """The one-time costs behind the methods' runs, in seconds of training on the machine that paid them and in
    training FLOPs: each latent method's autoencoder, and the feature network REPA's target comes from
    (perceptual/shapes.py TRAINING_SPEC, trained apart from the metrics' network). {name: {"seconds", "flops",
    "methods", "machine"}}."""
    out = {}
    for path, info in runner.autoencoders.items():
        users = [m for m in methods if build_config(runner.size, m, runner.size.seeds[0], runner.extra).latent.path]
        out[f"autoencoder {Path(path).name}"] = {"seconds": info.get("train_s"), "flops": info.get("train_flops"),
                                                 "methods": users, "machine": info.get("machine")}  # fmt: skip
    repa = [m for m in methods if build_config(runner.size, m, runner.size.seeds[0], runner.extra).loss.repa_weight]
    if repa:
        from reve_jax.perceptual import shapes

        _, info = shapes.get_feature_net(shapes.TRAINING_SPEC)
        out["REPA target network"] = {"seconds": info.get("train_s"), "flops": shapes.train_flops(shapes.TRAINING_SPEC),
                                      "methods": repa, "machine": None}  # fmt: skip
    return out


def _has(runs, metric) -> bool:
    return bool(runs) and all(r["curve"] and metric in r["curve"][-1] for r in runs)


def run_benchmark(size: Protocol, out_dir, *, methods=None, extra=(), cache_dir=None, evaluator_kwargs=None,
                  log: Callable[[str], None] = print, archive=None) -> dict:  # fmt: skip
    """Runs the baseline and `methods` (default: the size's headline methods) on every seed, seed by seed so slow
    drifts of the machine's load hit all methods alike, into `out_dir` (runs/, results.json, speedup.md,
    speedup.png), reusing finished runs. Returns the results dict."""
    if not size.config:
        raise ValueError("the protocol has no config file: load it with speedup.load_protocol(path)")
    size.check_seeds(size.seeds)
    out = Path(out_dir)
    runner = Runner(size, out, extra, cache_dir, evaluator_kwargs, log, archive)
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
            "one_time": one_time_costs(runner, methods=(size.baseline, *methods)),
            "split": size.split,
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
        with np.load(npz) as saved:
            # Images saved before the evaluation splits (no `split`) were of the training data's last indices.
            split = str(saved["split"]) if "split" in saved.files else None
            ds = pipeline.eval_dataset(cfg.data, split) if split else pipeline.dataset_from_config(cfg.data)
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

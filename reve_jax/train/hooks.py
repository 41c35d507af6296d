"""The trainer's hooks (see loop.py): stop requests, metrics and the NaN guard, sample grids, checkpoints.

Order matters and `trainer.default_hooks` keeps it: stop (sets ctx.stop) -> progress -> sample (its scores go
into this step's log line) -> log (raises on NaN before anything is saved) -> extra hooks (evaluation) ->
checkpoint (saves at its cadence, at the end and on a stop).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import jax
import numpy as np

from reve_jax import checkpoint, config, viz
from reve_jax.data import pipeline
from reve_jax.elastic.worker import any_process
from reve_jax.train import sampling, writer

log = logging.getLogger("reve_jax")


class NonFiniteError(RuntimeError):
    """Training produced a NaN or Inf at `step`; the last good checkpoint is left as it was."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class StopHook:
    """Ends the run when the worker context (signals, or the supervisor) asks for a stop. Every process must agree
    on the step: with several processes the flag is shared by a collective at log and checkpoint steps only."""

    timed = True

    def __init__(self, worker, cfg):
        self.worker, self.tr = worker, cfg.train

    def due(self, ctx) -> bool:
        if ctx.last:
            return False
        if jax.process_count() == 1:
            return True
        return _every(ctx.step, self.tr.log_every) or _every(ctx.step, self.tr.ckpt_every)

    def __call__(self, ctx):
        if any_process(self.worker.stop_requested()):
            ctx.stop = "stopped"


class LogHook:
    """Every train.log_every steps (and at checkpoints and the end): fetch the metrics, stop on a NaN/Inf, and
    write metrics.jsonl / TensorBoard with rates measured on the train clock."""

    timed = True

    def __init__(self, cfg, workdir: Path, ckpt: checkpoint.Checkpointer | None, peak_total: float, progress=None):
        """`peak_total`: the mesh's peak TFLOP/s (for MFU); `progress`: a tqdm bar to show loss and rate on."""
        self.cfg, self.ckpt, self.peak_total, self.progress = cfg, ckpt, peak_total, progress
        self.writer = writer.MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self._last = None  # (step, train wall seconds, FLOPs) at the last log

    def due(self, ctx) -> bool:
        tr = self.cfg.train
        return (
            _every(ctx.step, tr.log_every)
            or _every(ctx.step, tr.ckpt_every)
            or ctx.last
            or ctx.stop is not None
            or bool(ctx.extra)
        )

    def __call__(self, ctx):
        values = ctx.host_metrics()
        if self.cfg.train.stop_on_nan and not all(math.isfinite(v) for v in values.values()):
            last_good = self.ckpt.steps()[-1] if self.ckpt is not None and self.ckpt.steps() else "none"
            raise NonFiniteError(
                f"non-finite metrics at step {ctx.step}: {values}. The last good checkpoint ({last_good}) is "
                "intact; lower optim.lr or raise optim.clip_norm / warm-up, then resume.",
                ctx.step,
            )
        if not (_every(ctx.step, self.cfg.train.log_every) or ctx.last or ctx.extra):
            return
        wall, _ = ctx.clock.read()
        step0, wall0, flops0 = self._last or (ctx.start_step, ctx.start_wall, ctx.start_flops)
        dt = max(wall - wall0, 1e-9)
        n = ctx.step - step0
        ips = n * self.cfg.train.global_batch / dt
        tflops = (ctx.flops - flops0) / dt / 1e12
        record = dict(
            values,
            step_time=dt / max(n, 1),
            images_per_s=ips,
            tflops=tflops,
            mfu=tflops / self.peak_total,
            data_wait_frac=min(ctx.data_wait_s / dt, 1.0),
            train_wall_s=wall,
            **ctx.extra,
        )
        ctx.extra.clear()
        self.writer.write(ctx.step, record)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{values['loss']:.4f}", ips=f"{ips:.0f}")
        self._last, ctx.data_wait_s = (ctx.step, wall, ctx.flops), 0.0

    def close(self, ctx):
        self.writer.close()


def sample_prompts(cfg, dataset, n: int, index=None) -> tuple[list[str], dict]:
    """Captions and text inputs of samples `index` of `dataset` (default: its last `n`, fixed for the whole run);
    precomputed embeddings come from the records."""
    idx = np.arange(dataset.num_samples - n, dataset.num_samples) if index is None else np.asarray(index)
    text = pipeline.text_inputs_of(dataset, idx, cfg.text.max_len, cfg.text.encoder == "precomputed")
    return pipeline.captions_of(dataset, idx), text


class SampleHook:
    """Every train.sample_every steps and at the end: images for fixed captions from fixed noise, a grid of
    `sample.num` of them in <workdir>/samples/step_<n>.png.

    On the synthetic data the captions come from its evaluation splits (never in the training stream;
    pipeline.eval_dataset): the grid shows the first split's (unseen compositions where the data holds some out),
    and the reader (data/synthetic/alignment.py) scores `sample.score_num` captions of every split: per-attribute
    alignment goes to metrics.jsonl and TensorBoard (`sample/<split>/align_*`), the grid marks each caption's
    checks, and the last scores stay in `self.scores` ({split: scores}, the trainer's summary). On shards the
    captions are the dataset's last samples, and nothing is scored."""

    timed = False

    def __init__(self, run, workdir: Path, beat=None):
        self.run, self.workdir = run, Path(workdir)
        self.cfg = run.cfg
        self.beat = beat or (lambda step, phase="train": None)
        self.fn = sampling.make_sampler(self.cfg, run.setup.graphdef)
        s = self.cfg.sample
        self.sets: dict[str, tuple] = {}  # split -> (captions, text, scenes or None)
        if self.cfg.data.name == "synthetic":
            for i, name in enumerate(pipeline.eval_splits(self.cfg.data)):
                n = max(s.num, s.score_num) if i == 0 else s.score_num
                if n == 0:
                    continue
                ds = pipeline.eval_dataset(self.cfg.data, name)
                captions, text = sample_prompts(self.cfg, ds, n, index=range(n))
                self.sets[name] = (captions, text, [ds.scene(j) for j in range(n)] if s.score_num else None)
        elif s.num:  # sample.num 0: no grid
            captions, text = sample_prompts(self.cfg, run.stages[0].dataset, s.num)
            self.sets["last"] = (captions, text, None)
        self.scores: dict[str, dict[str, float]] = {}

    def due(self, ctx) -> bool:
        return (_every(ctx.step, self.cfg.train.sample_every) and not ctx.last) or (ctx.last and ctx.stop is None)

    def __call__(self, ctx):
        from reve_jax.data.synthetic import alignment

        self.beat(ctx.step, "sampling")
        path = self.workdir / "samples" / f"step_{ctx.step:07d}.png"
        for i, (name, (captions, text, scenes)) in enumerate(self.sets.items()):
            images = render(self.run, ctx.state, self.fn, text, ctx.step)
            grid = slice(0, self.cfg.sample.num)  # the grid: the first split's first sample.num captions
            rows = None
            if scenes is not None:
                checks = alignment.check_batch(alignment.read_batch(images[: len(scenes)]), scenes[: len(images)])
                scores = self.scores[name] = alignment.summarize(checks)
                log.info(
                    "step %d samples, %d %s captions: %s",
                    ctx.step,
                    len(scenes),
                    name,
                    ", ".join(f"{k[6:]} {v:.2f}" for k, v in scores.items()),
                )
                ctx.extra.update({f"sample/{name}/{k}": v for k, v in scores.items()})  # logged by LogHook
                n = len(scenes)
                rows = [{a: tuple(int(x) for x in checks[a][j]) for a in alignment.ATTRIBUTES} for j in range(n)]
            if i == 0 and self.cfg.sample.num and jax.process_index() == 0:
                path.parent.mkdir(exist_ok=True)
                if rows is None:
                    viz.save_sample_grid(path, images[grid], captions[grid])
                else:
                    viz.save_checked_grid(path, images[grid], captions[grid], rows[grid])


def render(run, state, fn, text, step: int) -> np.ndarray:
    """Images [n, H, W, 3] in [-1, 1] for `text` from the fixed sample noise, with the EMA (sample.use_ema) or
    the live weights, at the resolution of the current stage (its square size under aspect buckets)."""
    cfg = run.cfg
    params = state["ema"]["ema0"] if cfg.sample.use_ema else sampling.model_params(state["params"])
    n = len(next(iter(text.values())))
    hw = pipeline.batch_image_shape(run.stages, max(step - 1, 0))
    noise = sampling.fixed_noise(cfg, n, hw=hw)
    with jax.set_mesh(run.mesh):
        images = fn(params, text, noise, jax.random.key(cfg.sample.seed))
    return np.asarray(jax.device_get(images))


class CheckpointHook:
    """Saves the state, the data position and the run's totals every train.ckpt_every steps, at the end and when
    the run stops. With train.ckpt_overlap the device-to-host copy is staged behind the next step."""

    def __init__(self, cfg, ckpt: checkpoint.Checkpointer, beat=None):
        self.cfg, self.ckpt = cfg, ckpt
        self.beat = beat or (lambda step, phase="train": None)
        self.timed = cfg.train.ckpt_overlap  # a staged save is meant to hide behind the next step

    def due(self, ctx) -> bool:
        return _every(ctx.step, self.cfg.train.ckpt_every) or ctx.last or ctx.stop is not None

    def meta(self, ctx) -> dict:
        wall, cpu = ctx.clock.read()
        return {
            "data_position": ctx.step * self.cfg.train.global_batch,
            "config": config.to_json(self.cfg),
            "mesh": dict(ctx.run.mesh.shape),
            "processes": jax.process_count(),
            "train_wall_s": wall,
            "train_cpu_s": cpu,
            "train_flops": ctx.flops,
            "compile_s": ctx.run.compile_seconds,
        }

    def __call__(self, ctx):
        self.beat(ctx.step, "saving")
        final = ctx.last or ctx.stop is not None
        if self.cfg.train.ckpt_overlap and not final:
            self.ckpt.stage(ctx.step, ctx.state, self.meta(ctx))  # committed once the next step is dispatched
        else:
            self.ckpt.save(ctx.step, ctx.state, self.meta(ctx))
        if final:
            t0 = time.perf_counter()
            self.ckpt.wait()
            log.info("checkpoint %d written (%.1fs)", ctx.step, time.perf_counter() - t0)

    def after_dispatch(self, ctx):
        self.ckpt.commit()  # a staged save's host copy has run behind this step's dispatch

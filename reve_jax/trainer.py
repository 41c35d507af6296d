"""The training loop: Mesh -> Input -> State (created or restored sharded) -> compiled step -> Loop.

One code path for every config and every process count. The loop resumes from the newest complete checkpoint in
the workdir; its data position (samples consumed) restarts the input pipeline at exactly the next sample.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from pathlib import Path

import jax
import numpy as np

from reve_jax import checkpoint, config, flops, metrics, optim, sampling, sharding, train_state, viz, xla
from reve_jax.data import pipeline
from reve_jax.elastic.worker import any_process

log = logging.getLogger("reve_jax")


class NonFiniteError(RuntimeError):
    """Training produced a NaN or Inf; the last good checkpoint is left as it was."""


class _StopFlag:
    """SIGTERM / SIGINT (Ctrl-C) ask the loop to save a checkpoint and exit cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.requested = True
        log.warning("signal %d received: saving a checkpoint and stopping", signum)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _sample_prompts(cfg, dataset, n: int) -> tuple[list[str], dict]:
    """Captions and text inputs for the sample grid: the last `n` samples of the first stage's dataset (fixed
    for the whole run); precomputed embeddings come from the records."""
    idx = np.arange(dataset.num_samples - n, dataset.num_samples)
    text = pipeline.text_inputs_of(dataset, idx, cfg.text.max_len, cfg.text.encoder == "precomputed")
    return pipeline.captions_of(dataset, idx), text


def _check_shapes(cfg, shapes) -> None:
    """Every batch shape the data can produce must tile into patches (and DDT's coarse patches)."""
    patches = [cfg.model.patch] + ([cfg.model.ddt.enc_patch] if cfg.model.arch == "ddt" else [])
    for h, w in shapes:
        for p in patches:
            if h % p or w % p:
                raise ValueError(
                    f"the data gives {h}x{w} images, not divisible by the patch size {p}: prepare the shards "
                    "with --patch matching model.patch (and the DDT encoder patch)"
                )


# Config keys that decide the train state's structure and shapes: a checkpoint written under other values cannot
# be restored, and must not be mistaken for a corrupt one.
STATE_KEYS = (
    "model",
    "text",
    "optim.name",
    "optim.muon_patterns",
    "ema.decays",
    "loss.repa_weight",
    "loss.repa_dim",
    "loss.repa_hidden",
)


# State keys that change the layout of the same weights, not their values: scripts/convert_checkpoint.py moves a
# workdir across them.
LAYOUT_KEYS = ("model.scan_layers", "optim.muon_patterns")


def _flatten(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def state_key_changes(cfg, saved_json: str) -> dict[str, tuple]:
    """The STATE_KEYS entries whose values differ between a saved config (JSON) and `cfg`: key -> (saved, now)."""
    now = _flatten(json.loads(config.to_json(cfg)))
    then = _flatten(json.loads(saved_json))
    return {
        k: (then.get(k), now.get(k)) for k in sorted(set(now) | set(then))
        if any(k == p or k.startswith(p + ".") for p in STATE_KEYS) and now.get(k) != then.get(k)
    }  # fmt: skip


def check_compatible(cfg, saved_json: str) -> None:
    """Raise CheckpointError naming the differing keys when a workdir's checkpoints were written with a config
    whose train state has another structure (another model size, optimizer, EMA count)."""
    differ = state_key_changes(cfg, saved_json)
    if differ:
        detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in list(differ.items())[:6])
        hint = (
            " To continue this run under the new layout, write a converted copy with scripts/convert_checkpoint.py."
            if set(differ) <= set(LAYOUT_KEYS)
            else ""
        )
        raise checkpoint.CheckpointError(
            f"the checkpoints in this workdir were written by a different model or optimizer ({detail}). "
            f"Resume with the same config, or train in a new --workdir; nothing was changed.{hint}"
        )


def run(cfg, workdir: str | Path, worker=None) -> dict:
    """Train `cfg` in `workdir` until `train.steps` or a stop request. `worker` is the elastic worker context
    (heartbeats and group stop requests); None for a plain run. Returns a summary dict."""
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
    beat = worker.beat if worker is not None else (lambda step, phase="train": None)
    beat(0, "starting")
    if cfg.train.compile_cache:
        xla.enable_compile_cache(cfg.train.compile_cache)

    # ---------------------------------------------------------------- Mesh
    mesh = sharding.make_mesh(cfg.mesh)
    tr = cfg.train
    dp = sharding.data_parallel_size(mesh)
    if tr.global_batch % (dp * tr.grad_accum):
        raise sharding.MeshError(
            f"train.global_batch={tr.global_batch} must split evenly over {dp} data-parallel devices x "
            f"train.grad_accum={tr.grad_accum} micro-batches; change train.grad_accum or the batch"
        )
    log.info("mesh %s over %d devices, %d processes", dict(mesh.shape), mesh.size, jax.process_count())

    # ---------------------------------------------------------------- State
    setup = train_state.make_setup(cfg, mesh)
    if is_main:
        log.info(
            "parameter groups:\n%s",
            optim.describe_param_groups(setup.abstract_state["params"], setup.param_labels),
        )
    ckpt = checkpoint.Checkpointer(workdir, keep=tr.ckpt_keep, async_save=tr.ckpt_async)
    beat(0, "restoring")
    if ckpt.steps():
        try:
            saved = ckpt.restore_meta(ckpt.steps()[-1])["config"]
        except Exception:  # unreadable metadata: restore_latest below sets the step aside and falls back
            saved = None
        if saved is not None:
            check_compatible(cfg, saved)
    restored = ckpt.restore_latest(setup.abstract_state)
    if restored is None:
        state, position = train_state.init_state(setup), 0
        log.info("fresh start")
    else:
        state, meta = restored
        position = int(meta["data_position"])
        log.info("resumed from step %d (data position %d)", meta["step"], position)
    if is_main:  # written only once the workdir is known to hold this run (or nothing)
        (workdir / "config.json").write_text(config.to_json(cfg))
    start_step = int(jax.device_get(state["step"]))
    if position != start_step * tr.global_batch:
        raise checkpoint.CheckpointError(
            f"checkpoint data position {position} does not match step {start_step} x train.global_batch="
            f"{tr.global_batch}: the global batch changed since the checkpoint was written; keep it fixed"
        )

    # ---------------------------------------------------------------- Input
    stages = pipeline.make_stages(cfg.data, tr.global_batch)
    data_iter = pipeline.make_batch_iterator(
        cfg.data,
        cfg.text.max_len,
        tr.global_batch,
        jax.process_index(),
        jax.process_count(),
        position,
        text_cfg=cfg.text,
        stages=stages,
    )
    _check_shapes(cfg, pipeline.image_shapes(stages))
    dataset = stages[0].dataset
    sample_fn = sampling.make_sampler(cfg, setup.graphdef)
    n_samples = cfg.sample.num
    captions, sample_text = _sample_prompts(cfg, dataset, n_samples)

    # ---------------------------------------------------------------- Compile
    batch_keys = ("image", "tokens", "text_emb", "text_mask")
    device_batch = lambda local: sharding.global_batch_from_local(  # noqa: E731
        {k: v for k, v in local.items() if k in batch_keys}, mesh, tr.global_batch
    )
    batch = device_batch(next(data_iter))
    step_fn = train_state.jit_train_step(setup, jax.tree.map(lambda a: a.sharding, batch))
    executables = {}  # image (H, W) -> compiled step: one per resolution stage or aspect bucket
    step_flops = {}  # image (H, W) -> training FLOPs of one step
    compile_s = 0.0

    def executable(batch, step_now: int):
        nonlocal compile_s
        hw = tuple(batch["image"].shape[1:3])
        if hw not in executables:
            beat(step_now, "compiling")
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                executables[hw] = step_fn.lower(state, batch, setup.frozen.states).compile()
            step_flops[hw] = flops.train_flops_per_image(cfg, hw) * tr.global_batch
            took = time.perf_counter() - t0
            compile_s += took
            mem = executables[hw].memory_analysis()
            if mem is not None and is_main:
                log.info(
                    "compiled the train step for %dx%d images in %.1fs; per-device temp %.1f MiB, args %.1f MiB",
                    *hw,
                    took,
                    mem.temp_size_in_bytes / 2**20,
                    mem.argument_size_in_bytes / 2**20,
                )
        return executables[hw], step_flops[hw]

    executable(batch, start_step)
    peak, peak_src = metrics.peak_tflops(tr.peak_tflops)
    peak_total = peak * jax.device_count()

    # ---------------------------------------------------------------- Loop
    writer = metrics.MetricsWriter(workdir, enabled=is_main)
    stop = _StopFlag()
    stop.install()
    progress = _progress(is_main, start_step, tr.steps)
    step = start_step
    t_last, steps_since = time.perf_counter(), 0
    data_wait, flops_since = 0.0, 0.0
    reason = "finished"

    def save(step_now: int, wait: bool = False):
        beat(step_now, "saving")
        meta = {
            "data_position": step_now * tr.global_batch,
            "config": config.to_json(cfg),
            "mesh": dict(mesh.shape),
            "processes": jax.process_count(),
        }
        if tr.ckpt_overlap and not wait:
            ckpt.stage(step_now, state, meta)  # committed once the next step is dispatched
        else:
            ckpt.save(step_now, state, meta)
        if wait:
            ckpt.wait()

    def render(step_now: int):
        beat(step_now, "sampling")
        params = state["ema"]["ema0"] if cfg.sample.use_ema else state["params"]
        # Sample at the current stage's resolution (its square size under aspect buckets).
        noise = sampling.fixed_noise(cfg, n_samples, hw=pipeline.batch_image_shape(stages, max(step_now - 1, 0)))
        with jax.set_mesh(mesh):
            imgs = sample_fn(params, sample_text, noise, jax.random.key(cfg.sample.seed))
        imgs = np.asarray(jax.device_get(imgs))
        if is_main:
            (workdir / "samples").mkdir(exist_ok=True)
            viz.save_sample_grid(workdir / "samples" / f"step_{step_now:07d}.png", imgs, captions)

    try:
        while step < tr.steps:
            compiled, flops_per_step = executable(batch, step)
            with jax.set_mesh(mesh):
                state, m = compiled(state, batch, setup.frozen.states)
            ckpt.commit()  # a staged save's host copy has run behind this step's dispatch (train.ckpt_overlap)
            flops_since += flops_per_step
            step += 1
            steps_since += 1
            t_data = time.perf_counter()
            if step < tr.steps:
                batch = device_batch(next(data_iter))
            data_wait += time.perf_counter() - t_data
            progress.update(1)
            beat(step)
            at_log = step % tr.log_every == 0 or step == tr.steps
            at_ckpt = step % tr.ckpt_every == 0 or step == tr.steps
            if at_log or at_ckpt:
                values = jax.device_get(m)
                if tr.stop_on_nan and not all(math.isfinite(float(v)) for v in values.values()):
                    raise NonFiniteError(
                        f"non-finite metrics at step {step}: {values}. The last good checkpoint "
                        f"({ckpt.steps()[-1] if ckpt.steps() else 'none'}) is intact; lower optim.lr or raise "
                        "optim.clip_norm / warm-up, then resume."
                    )
                if at_log:
                    dt = time.perf_counter() - t_last
                    ips = steps_since * tr.global_batch / dt
                    tflops = flops_since / dt / 1e12
                    record = dict(
                        values,
                        step_time=dt / steps_since,
                        images_per_s=ips,
                        tflops=tflops,
                        mfu=tflops / peak_total,
                        data_wait_frac=data_wait / dt,
                        epoch_position=step,
                    )
                    writer.write(step, record)
                    progress.set_postfix(loss=f"{values['loss']:.4f}", ips=f"{ips:.0f}")
                    t_last, steps_since, data_wait, flops_since = time.perf_counter(), 0, 0.0, 0.0
            if tr.sample_every and step % tr.sample_every == 0 and step < tr.steps:
                render(step)
            if at_ckpt:
                save(step)
            local_stop = stop.requested or (worker is not None and worker.stop_requested())
            check_now = jax.process_count() == 1 or at_log or at_ckpt
            if check_now and any_process(local_stop) and step < tr.steps:
                reason = "stopped"
                save(step, wait=True)
                break
        if reason == "finished":
            render(step)
        ckpt.wait()
    finally:
        stop.restore()
        progress.close()
        writer.close()
        ckpt.close()
    if is_main and reason == "finished":
        viz.save_loss_plot(workdir / "loss.png", workdir / "metrics.jsonl")
    summary = {
        "reason": reason,
        "step": step,
        "start_step": start_step,
        "compiled_shapes": sorted(executables),
        "compile_s": compile_s,
        "peak_tflops_source": peak_src,
    }
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class _NoProgress:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def _progress(enabled: bool, start: int, total: int):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=2.0)

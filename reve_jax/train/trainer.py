"""Training a config in a workdir: build the run (builder.py), restore or start, then the one loop (loop.py) with
the trainer's hooks (hooks.py) and any the caller adds (the speedup benchmark's evaluation).

One code path for every config and every process count. The run resumes from the newest complete checkpoint in
the workdir; its data position (samples consumed) restarts the input pipeline at exactly the next sample, and its
train clock and FLOP count carry on from the checkpoint. A workdir that holds checkpoints, or checkpoints set
aside as corrupt, never silently starts over at step 0: that takes `fresh=True` (`--fresh`), which keeps the old
checkpoints in `checkpoints_replaced/`.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import jax

from reve_jax import checkpoint, config, flops, optim, xla
from reve_jax.data import pipeline
from reve_jax.elastic import inprocess
from reve_jax.elastic.snapshot import Snapshots
from reve_jax.elastic.worker import stop_on_signals
from reve_jax.train import builder, hooks, loop

log = logging.getLogger("reve_jax")

NonFiniteError = hooks.NonFiniteError

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

# Keys inside STATE_KEYS' sections that do not shape the state (a run may record or change them).
NOT_STATE_KEYS = ("text.frozen_encoder", "text.frozen_encoder_path")

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
    then = _flatten(json.loads(config.to_json(config.from_json(saved_json))))  # with the keys it predates
    return {
        k: (then.get(k), now.get(k)) for k in sorted(set(now) | set(then))
        if any(k == p or k.startswith(p + ".") for p in STATE_KEYS) and k not in NOT_STATE_KEYS
        and now.get(k) != then.get(k)
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


def _log_param_groups(run, workdir: Path) -> None:
    """The full parameter table goes to <workdir>/params.txt; the console gets one line per optimizer group."""
    setup = run.setup
    table = optim.describe_param_groups(setup.abstract_state["params"], setup.param_labels)
    (workdir / "params.txt").write_text(table + "\n")
    for line in optim.group_summary(setup.abstract_state["params"], setup.param_labels):
        log.info("%s", line)
    log.info("parameter table: %s", workdir / "params.txt")


class _NullWorker:
    """The worker context of a plain (unsupervised) run."""

    def beat(self, step: int, phase: str = "train") -> None:
        pass

    def stop_requested(self) -> bool:
        return False


class ProgressHook:
    """A tqdm bar on process 0, advanced every step."""

    timed = True

    def __init__(self, start: int, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=2.0)

    def due(self, ctx) -> bool:
        return True

    def __call__(self, ctx):
        self.bar.update(ctx.step - self.bar.n)

    def close(self, ctx):
        self.bar.close()


class _SignalStop:
    """Adapts a worker context so a local SIGTERM/SIGINT also asks for a stop."""

    def __init__(self, worker, signalled: threading.Event):
        self.worker, self.signalled = worker, signalled

    def stop_requested(self) -> bool:
        return self.signalled.is_set() or self.worker.stop_requested()


def restore(run, ckpt: checkpoint.Checkpointer, *, fresh: bool, snapshots: Snapshots | None = None):
    """The state to train from and its checkpoint metadata ({} for a fresh start). Refuses a workdir whose
    checkpoints were written by another model or optimizer before touching them. With `snapshots`, the newest
    complete in-memory snapshot wins over an older disk checkpoint (elastic/snapshot.py)."""
    steps = ckpt.steps()
    if steps and not fresh:
        try:
            saved = ckpt.restore_meta(steps[-1])["config"]
        except Exception:  # unreadable metadata: checkpoint.resume decides whether the step is corrupt
            saved = None
        if saved is not None:
            check_compatible(run.cfg, saved)
    if snapshots is not None:
        got = snapshots.restore(run.setup.abstract_state, newer_than=steps[-1] if steps else 0, fresh=fresh)
        if got is not None:
            return got
    restored = checkpoint.resume(ckpt, run.setup.abstract_state, fresh=fresh)
    if restored is None:
        log.info("fresh start")
        return run.init_state(), {}
    state, meta = restored
    log.info("resumed from step %d (data position %d)", meta["step"], meta["data_position"])
    return state, meta


def default_hooks(run, workdir: Path, ckpt, worker, signalled: threading.Event, start_step: int, peak: float):
    """stop -> progress -> sample -> log; the checkpoint hook is appended after any caller's hooks. `peak`: one
    device's peak TFLOP/s (for MFU)."""
    cfg, is_main = run.cfg, jax.process_index() == 0
    progress = ProgressHook(start_step, cfg.train.steps) if is_main else None
    out = [hooks.StopHook(_SignalStop(worker, signalled), cfg)]
    out += [progress] if progress is not None else []
    out += [hooks.SampleHook(run, workdir, worker.beat)]  # before the log hook, which writes its scores
    out += [hooks.LogHook(cfg, workdir, ckpt, peak * jax.device_count(), progress.bar if progress else None)]
    return out


def run(cfg, workdir: str | Path, worker=None, *, fresh: bool = False, extra_hooks=()) -> dict:
    """Train `cfg` in `workdir` until `train.steps` or a stop request. `worker` is the elastic worker context
    (heartbeats and group stop requests); None for a plain run. `fresh` starts at step 0 even where checkpoints
    exist (they are kept aside). `extra_hooks` run after the sample hook and before the checkpoint hook.
    Returns a summary dict (also written to <workdir>/summary.json)."""
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
    worker = worker if worker is not None else _NullWorker()
    inprocess.require_trainer_support(worker)
    worker.beat(0, "starting")
    if cfg.train.compile_cache:
        xla.enable_compile_cache(cfg.train.compile_cache)

    cfg = config.from_json(config.to_json(cfg))  # a copy: the run records what it learns about its data below
    run_ = builder.build(cfg)
    if cfg.text.encoder == "precomputed" and not cfg.text.frozen_encoder:
        cfg.text.frozen_encoder = run_.stages[0].dataset.encoder["name"]  # so that sampling can encode prompts
    peak, peak_source = flops.peak_tflops(cfg.train.peak_tflops)
    log.info("mesh %s over %d devices, %d processes", dict(run_.mesh.shape), run_.mesh.size, jax.process_count())
    if is_main:
        _log_param_groups(run_, workdir)
    ckpt = checkpoint.Checkpointer(workdir, keep=cfg.train.ckpt_keep, async_save=cfg.train.ckpt_async)
    snaps, result = None, None
    try:
        worker.beat(0, "restoring")
        snaps = Snapshots.create(cfg, workdir, worker, run_.setup.abstract_state, fresh=fresh)
        state, meta = restore(run_, ckpt, fresh=fresh, snapshots=snaps)
        if is_main:  # written only once the workdir is known to hold this run (or nothing)
            (workdir / "config.json").write_text(config.to_json(cfg))
        start_step = int(jax.device_get(state["step"]))
        position = int(meta.get("data_position", 0))
        if position != start_step * cfg.train.global_batch:
            raise checkpoint.CheckpointError(
                f"checkpoint data position {position} does not match step {start_step} x train.global_batch="
                f"{cfg.train.global_batch}: the global batch changed since the checkpoint was written; keep it fixed"
            )
        worker.beat(start_step, "compiling")
        run_.image_shapes()  # every shape the data gives must tile into patches
        run_.compile(pipeline.batch_image_shape(run_.stages, start_step))  # others compile when first met
        clock = loop.Clock(meta.get("train_wall_s", 0.0), meta.get("train_cpu_s", 0.0))
        signalled = threading.Event()
        all_hooks = default_hooks(run_, workdir, ckpt, worker, signalled, start_step, peak)
        ckpt_hook = hooks.CheckpointHook(cfg, ckpt, worker.beat)
        all_hooks += [*extra_hooks, *([snaps.hook(ckpt_hook.meta)] if snaps else []), ckpt_hook]
        with stop_on_signals(signalled):
            result = loop.run_loop(
                run_,
                state,
                run_.batches(start_step * cfg.train.global_batch),
                start_step,
                cfg.train.steps,
                all_hooks,
                clock=clock,
                flops=meta.get("train_flops", 0.0),
                beat=worker.beat,
            )
    finally:
        ckpt.close()
        if snaps is not None:
            snaps.close(finished=result is not None and result.reason == "finished")
    if is_main and result.reason == "finished":
        from reve_jax import viz

        viz.save_loss_plot(workdir / "loss.png", workdir / "metrics.jsonl")
    summary = {
        "reason": result.reason,
        "step": result.step,
        "start_step": start_step,
        "compiled_shapes": sorted(run_.compiled),
        "compile_s": run_.compile_seconds,
        "step_flops_executed": {f"{h}x{w}": c.executed_flops for (h, w), c in sorted(run_.compiled.items())},
        "train_wall_s": clock.wall_s,
        "train_cpu_s": clock.cpu_s,
        "peak_tflops_source": peak_source,
    }
    if snaps is not None:
        summary["snapshots"] = snaps.summary()
    sampled = next(h for h in all_hooks if isinstance(h, hooks.SampleHook))
    if sampled.scores:  # the reader's scores of the last samples, per evaluation split (synthetic data)
        summary["samples_scored"] = cfg.sample.score_num
        summary.update(sampled.scores)
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary

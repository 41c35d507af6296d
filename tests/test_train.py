"""The training loop end to end: exact resume, train.py in a subprocess with SIGTERM and its artifacts, NaN
handling, and a tiny overfit."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from util import TINY, tiny_config, xla_flags

from reve_jax import sharding
from reve_jax.checkpoint import Checkpointer, CheckpointError
from reve_jax.train import builder, train_state, trainer


class StopAt:
    """A stand-in for the elastic worker context that asks the loop to stop at a given step."""

    def __init__(self, step):
        self.stop_step, self.step = step, 0

    def beat(self, step, phase="train"):
        self.step = step

    def stop_requested(self):
        return self.step >= self.stop_step


def _final(workdir, cfg):
    setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
    state, meta = Checkpointer(workdir).restore_latest(setup.abstract_state)
    return jax.device_get(state), meta


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def test_resume_is_exact(tmp_path):
    """A run stopped at step 3 and resumed ends bit-identical to one that never stopped. The split run stages its
    checkpoints behind the next step (train.ckpt_overlap), so its step-2 and step-3 saves must also hold exactly
    what a blocking save would."""
    cfg = tiny_config("train.steps=6", "train.log_every=1", "optim.name='muon'")
    staged = tiny_config("train.steps=6", "train.log_every=1", "optim.name='muon'", "train.ckpt_overlap=True")
    trainer.run(cfg, tmp_path / "straight")
    first = trainer.run(staged, tmp_path / "split", worker=StopAt(3))
    assert first == dict(first, reason="stopped", step=3)
    setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
    blocking, overlapped = Checkpointer(tmp_path / "straight"), Checkpointer(tmp_path / "split")
    try:
        assert overlapped.steps() == [2, 3]
        a, _ = blocking.restore(2, setup.abstract_state)
        b, meta = overlapped.restore(2, setup.abstract_state)
        assert meta["data_position"] == 2 * cfg.train.global_batch
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"staged step 2 {jax.tree_util.keystr(path)}")
    finally:
        blocking.close()
        overlapped.close()
    second = trainer.run(staged, tmp_path / "split")
    assert second["start_step"] == 3 and second["step"] == 6
    a, meta_a = _final(tmp_path / "straight", cfg)
    b, meta_b = _final(tmp_path / "split", cfg)
    assert meta_a["step"] == meta_b["step"] == 6 and meta_b["data_position"] == 6 * cfg.train.global_batch
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "split")


def test_nan_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny_config("train.steps=2")
    trainer.run(cfg, tmp_path)
    good, _ = _final(tmp_path, cfg)
    bad = tiny_config("train.steps=8", "optim.lr=1e38", "optim.clip_norm=0.0", "optim.warmup_steps=0")
    with pytest.raises(trainer.NonFiniteError, match="non-finite metrics at step"):
        trainer.run(bad, tmp_path)
    after, meta = _final(tmp_path, cfg)
    assert meta["step"] == 2
    for x, y in zip(jax.tree.leaves(good), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)


def test_tiny_overfit_drives_the_loss_down():
    cfg = tiny_config(
        "optim.lr=3e-3", "optim.warmup_steps=5", "diffusion.caption_drop=0.0", "diffusion.t_sampler='uniform'"
    )
    run = builder.build(cfg)
    state = run.init_state()
    batch = next(run.batches(0))
    losses = []
    for _ in range(150):
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    assert np.mean(losses[-20:]) < 0.3 * np.mean(losses[:20]), (losses[:5], losses[-5:])


def _train_cmd(workdir, *extra):
    return [
        sys.executable,
        "scripts/train.py",
        "--config",
        "configs/tiny.py",
        "--workdir",
        str(workdir),
        *(f"--config.{o}" for o in TINY),
        *extra,
    ]


def test_train_script_end_to_end_with_sigterm_and_resume(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    cmd = _train_cmd(tmp_path, "--config.train.steps=100000", "--config.train.log_every=1")
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = json.loads((tmp_path / "summary.json").read_text())
    assert stopped["reason"] == "stopped"
    assert Checkpointer(tmp_path).steps()[-1] == stopped["step"]
    # The next launch resumes where the stop left off and finishes.
    final_step = stopped["step"] + 2
    done = subprocess.run(
        _train_cmd(tmp_path, f"--config.train.steps={final_step}", "--config.sample.num=2"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == dict(summary, reason="finished", start_step=stopped["step"], step=final_step)
    assert list((tmp_path / "samples").glob("*.png")) and (tmp_path / "loss.png").stat().st_size > 1000
    assert list((tmp_path / "tb").iterdir()) and (tmp_path / "config.json").exists()
    assert max(_losses(tmp_path)) == final_step
    # scripts/sample.py renders a grid from the newest checkpoint for prompts on the command line.
    out = tmp_path / "cli.png"
    sampled = subprocess.run(
        [sys.executable, "scripts/sample.py", "--workdir", str(tmp_path), "--out", str(out), "--steps", "2",
         "--prompt", "a small red circle in the center, on a white background", "--prompt", "a large blue square"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert out.exists() and out.stat().st_size > 1000


def test_resuming_with_another_model_is_refused_and_keeps_the_checkpoints(tmp_path):
    cfg = tiny_config("train.steps=2")
    trainer.run(cfg, tmp_path)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    wider = tiny_config("train.steps=4", "model.width=64")
    with pytest.raises(CheckpointError, match="model.width: saved 32, now 64"):
        trainer.run(wider, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert not (tmp_path / "checkpoints_corrupt").exists()
    trainer.check_compatible(tiny_config("optim.lr=1e-5"), (tmp_path / "config.json").read_text())  # lr may change
    with pytest.raises(CheckpointError, match="model.scan_layers: saved False, now True.*convert_checkpoint.py"):
        trainer.check_compatible(tiny_config("model.scan_layers=True"), (tmp_path / "config.json").read_text())

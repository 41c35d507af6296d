"""The evaluation hook: scores the live EMA weights every `every` steps and at the end of a trainer run, off the
train clock, and appends one point per evaluation to <workdir>/eval.jsonl:

    {"step", "samples", "flops", "wall_s", "cpu_s", "train_loss", <every metric of quality.Evaluator>}

wall_s and cpu_s are the run's cumulative training time (loop.Clock: compilation, evaluation, sampling and
checkpoint writes excluded), carried across a resume by the checkpoints. The images of every evaluation are kept
(uint8, <workdir>/eval_images/step_<n>.npz) so the metrics can be recomputed without retraining. A resumed run
drops the points after its checkpoint (they are evaluated again, on the same weights).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from reve_jax import viz
from reve_jax.data import pipeline
from reve_jax.metrics import quality


def read_points(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class EvalHook:
    """Evaluate every `every` steps and at the end (see the module docstring).

    Args:
      workdir: the run's directory (eval.jsonl, eval_images/, eval_grid.png).
      every: cadence in steps.
      n_eval, seed: held-out captions and the evaluation noise seed (quality.Evaluator).
      evaluator_kwargs: more Evaluator arguments (feature net cache, DINOv2 weights).
      on_eval: called with each new point.
      n_final: the last evaluation is also made on this many captions, its metrics stored as `final_<name>`
        (None: not); the controls are not scored again there.
      split: the caption set every evaluation scores (quality.Evaluator; default: unseen compositions where the
        data holds some out); each point records it as "split".
    """

    timed = False

    def __init__(
        self,
        workdir: str | Path,
        every: int,
        n_eval: int,
        seed: int,
        evaluator_kwargs: dict | None = None,
        on_eval: Callable[[dict], None] | None = None,
        n_final: int | None = None,
        split: str | None = None,
    ):
        self.workdir = Path(workdir)
        self.every, self.n_eval, self.seed = every, n_eval, seed
        self.kwargs = dict(evaluator_kwargs or {})
        self.on_eval = on_eval
        self.n_final = n_final
        self.split = split
        self.path = self.workdir / "eval.jsonl"
        self.images_dir = self.workdir / "eval_images"
        self.evaluator: quality.Evaluator | None = None
        self._trimmed = False

    def due(self, ctx) -> bool:
        return (self.every > 0 and ctx.step % self.every == 0) or ctx.last

    def _trim(self, start_step: int) -> None:
        """Drop points written after the checkpoint this run resumed from."""
        kept = [p for p in read_points(self.path) if p["step"] <= start_step]
        if jax.process_index() == 0:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(p) + "\n" for p in kept))
        self._trimmed = True

    def __call__(self, ctx):
        if not self._trimmed:
            self._trim(ctx.start_step)
        if self.evaluator is None:
            self.evaluator = quality.Evaluator(
                ctx.run.cfg, ctx.run.setup.graphdef, self.n_eval, self.seed, mesh=ctx.run.mesh, split=self.split,
                **self.kwargs,
            )  # fmt: skip
        wall, cpu = ctx.clock.read()
        train = ctx.host_metrics()
        point = {
            "step": ctx.step,
            "samples": ctx.samples,
            "flops": ctx.flops,
            "wall_s": wall,
            "cpu_s": cpu,
            "train_loss": train["loss"],
            "split": self.evaluator.split,
        }
        if not math.isfinite(train["loss"]):
            point["diverged"] = True
        else:
            ema = ctx.state["ema"]["ema0"]
            images = self.evaluator.generate(ema)
            point.update(self.evaluator(ema, images=images))
            # Per caption, the checks behind the alignment scores: the benchmark resamples captions with them.
            point["checks"] = {a: c.astype(int).tolist() for a, c in self.evaluator.last_checks.items()}
            if ctx.last and self.n_final:
                final = quality.Evaluator(  # the controls were scored once on the n_eval captions
                    ctx.run.cfg, ctx.run.setup.graphdef, self.n_final, self.seed, mesh=ctx.run.mesh,
                    with_controls=False, split=self.evaluator.split, **self.kwargs,
                )  # fmt: skip
                point.update({f"final_{k}": v for k, v in final(ema).items()})
            if jax.process_index() == 0:
                self.images_dir.mkdir(parents=True, exist_ok=True)
                np.savez_compressed(self.images_dir / f"step_{ctx.step:07d}.npz", images=viz.to_uint8(images))
                if ctx.last:
                    captions = pipeline.captions_of(self.evaluator.dataset, self.evaluator.heldout["index"][:16])
                    viz.save_sample_grid(self.workdir / "eval_grid.png", images[:16], captions)
        if jax.process_index() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(point) + "\n")
        if self.on_eval is not None:
            self.on_eval(point)
        if point.get("diverged"):
            ctx.stop = "diverged"

    def heldout_index(self) -> np.ndarray | None:
        return None if self.evaluator is None else self.evaluator.heldout["index"]


def load_images(workdir: str | Path) -> dict[int, np.ndarray]:
    """Every saved evaluation's images of a run: step -> uint8 [n, H, W, 3]."""
    out = {}
    for f in sorted((Path(workdir) / "eval_images").glob("step_*.npz")):
        with np.load(f) as z:
            out[int(f.stem.removeprefix("step_"))] = z["images"]
    return out

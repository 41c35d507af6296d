"""Every quality metric of a set of weights, on fixed held-out captions, noise and seeds.

`evaluate(cfg, params, graphdef, n_images, seed)` samples one image per held-out caption (the last `n_images`
indices of the dataset) with the sampler, step count and guidance of `cfg.sample`, from noise fixed by `seed`, and
returns a flat dict of floats:

- align_*: caption alignment (alignment.py), the primary metric; align_overall is the mean over attributes;
- fd_shapes: Fréchet distance between generated and real held-out images in the feature net's space (features.py);
- fd_dinov2: the same in DINOv2's space, when `dinov2_path` names a converted DINOv2 file;
- vloss, vloss_t<t>: held-out v-loss at fixed t and noise (vloss.py);
- eval_s: seconds the evaluation took.

Pass the EMA weights (`state["ema"]["ema0"]`) for benchmark numbers. `Evaluator` holds the compiled functions and
the real images' statistics, for scoring many checkpoints of one model.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
import numpy as np

from reve_jax import sampling
from reve_jax.data import synthetic
from reve_jax.eval import alignment, features, vloss


class Evaluator:
    """Scores weights of the model `graphdef` of `cfg` on `n_images` held-out captions, noise from `seed`.

    Args:
      cfg: the run's config (its `sample` section fixes the sampler, steps and guidance; `data` the captions).
      graphdef: the model's graph (from `nnx.split`).
      n_images: held-out captions (and real images for the Fréchet distances) to score on.
      seed: seed of the sampling noise (the v-loss noise uses seed + 1).
      feature_spec, cache_dir: the feature net (see features.get_feature_net); feature_spec=None skips fd_shapes.
      dinov2_path: converted DINOv2 file for fd_dinov2 (None: skipped); dinov2_pool: "cls" or "mean".
      batch: images sampled per call (bounds memory).
      mesh: mesh to run the sampler under (the params' mesh), or None.
    """

    def __init__(
        self,
        cfg,
        graphdef,
        n_images: int,
        seed: int,
        *,
        feature_spec: features.FeatureSpec | None = features.DEFAULT_SPEC,
        cache_dir: str | Path | None = None,
        dinov2_path: str | Path | None = None,
        dinov2_pool: str = "cls",
        batch: int = 256,
        mesh=None,
    ):
        if cfg.data.name != "synthetic":
            raise ValueError("evaluation needs the procedural dataset (data.name='synthetic'): captions are read back")
        self.cfg, self.seed, self.batch, self.mesh = cfg, seed, batch, mesh
        self.heldout = vloss.heldout_batch(cfg, n_images)
        ds = synthetic.SyntheticShapes(cfg.data.image_size, cfg.data.num_samples, cfg.data.seed, cfg.data.max_objects)
        self.scenes = [ds.scene(int(i)) for i in self.heldout["index"]]
        self.text = {k: self.heldout[k] for k in ("tokens", "text_emb", "text_mask") if k in self.heldout}
        self.noise = sampling.fixed_noise(cfg, n_images, seed)
        self.sample_fn = sampling.make_sampler(cfg, graphdef)
        self.vloss_fn = vloss.make_vloss_fn(cfg, graphdef)
        real = self.heldout["image"]
        self.feature_fn = self.real_stats = None
        if feature_spec is not None:
            net, _ = features.get_feature_net(feature_spec, cache_dir)
            self.feature_fn = features.make_feature_fn(net)
            self.real_stats = features.gaussian_stats(self.feature_fn(real))
        self.dino_fn = self.dino_stats = None
        if dinov2_path:
            self.dino_fn = features.make_dinov2_fn(dinov2_path, dinov2_pool)
            self.dino_stats = features.gaussian_stats(self.dino_fn(real))

    def _ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def generate(self, params) -> np.ndarray:
        """Images for the held-out captions: f32 [n_images, S, S, 3] in [-1, 1]."""
        out = []
        key = jax.random.key(self.seed)
        with self._ctx():
            for i in range(0, len(self.noise), self.batch):
                text = {k: v[i : i + self.batch] for k, v in self.text.items()}
                out.append(
                    np.asarray(jax.device_get(self.sample_fn(params, text, self.noise[i : i + self.batch], key)))
                )
        return np.concatenate(out)

    def __call__(self, params, images: np.ndarray | None = None) -> dict[str, float]:
        """All metrics of `params` (or of given `images` [n_images,S,S,3] in [-1, 1], for the image metrics)."""
        t0 = time.perf_counter()
        images = self.generate(params) if images is None else images
        out = alignment.score(images, self.scenes)
        if self.feature_fn is not None:
            out["fd_shapes"] = features.frechet_distance(
                *features.gaussian_stats(self.feature_fn(images)), *self.real_stats
            )
        if self.dino_fn is not None:
            out["fd_dinov2"] = features.frechet_distance(
                *features.gaussian_stats(self.dino_fn(images)), *self.dino_stats
            )
        with self._ctx():
            out.update(
                vloss.heldout_vloss(
                    self.cfg, params, None, len(self.noise), self.seed + 1, fn=self.vloss_fn, batch=self.heldout
                )
            )
        out["eval_s"] = time.perf_counter() - t0
        return out


def evaluate(cfg, params, graphdef, n_images: int, seed: int, **kwargs) -> dict[str, float]:
    """One-off evaluation of `params` (see the module docstring for the metrics); `kwargs` go to `Evaluator`."""
    return Evaluator(cfg, graphdef, n_images, seed, **kwargs)(params)

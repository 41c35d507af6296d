"""Every quality metric of a set of weights, on fixed held-out captions, noise and seeds, with bootstrap intervals
and the controls that show what each number means.

`Evaluator(cfg, graphdef, n_images, seed, split=...)` samples one image per held-out caption (the first `n_images`
samples of an evaluation split of the data, never in the training stream: "unseen" compositions by default,
"seen" ones beside them; pipeline.eval_dataset) with the sampler, step count and guidance of `cfg.sample`, from
noise fixed by `seed`. Calling it returns a flat dict of floats (the caller names the split they were scored on):

- align_<attribute> for background, count, position, color, shape, size, and align_overall (their mean, the
  primary metric) and align_exact (every check of the caption right): caption alignment read from the pixels
  (alignment.py);
- kid: KID between the (caption, image) pairs generated and the real ones, in the feature net's space joined with
  the caption's scene (kid.py); kid_image: the same on the images alone; kid_floor, kid_image_floor: the same
  distances for a second real image per caption (the real-vs-real floor, what a perfect model scores on average);
- every metric above with <name>_lo and <name>_hi: its 95% bootstrap interval over captions (bootstrap.py);
- ctrl_<control>_align_overall, ctrl_<control>_align_exact, ctrl_<control>_kid, ctrl_<control>_grain for the
  controls real, shuffled, background, one_object and noisy (controls.py), computed once: each must lie clearly
  below real images on the metrics that read what is wrong with it;
- grain: high-frequency noise in flat regions, the mean over images of the median absolute 4-neighbour Laplacian
  of the pixels in [0, 1] (real images: 0; Gaussian pixel noise of std s in [-1, 1] reads about 1.75 s); a
  diagnostic, with no interval;
- fd_shapes: Fréchet distance in the feature net's space (biased upwards at small n: prefer kid); fd_dinov2: the
  same in DINOv2's space, when `dinov2_path` names a converted DINOv2 file;
- vloss, vloss_t<t>: held-out v-loss at fixed t and noise (vloss.py); eval_s: seconds the evaluation took.

Pass the EMA weights (`state["ema"]["ema0"]`) for benchmark numbers. The Evaluator holds the compiled functions,
the real images' features and the controls' scores, for scoring many checkpoints of one model.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
import numpy as np

from reve_jax import viz
from reve_jax.data import pipeline
from reve_jax.data.synthetic import alignment, controls
from reve_jax.metrics import bootstrap, frechet, kid, vloss
from reve_jax.perceptual import shapes
from reve_jax.progress import Progress
from reve_jax.train import sampling


def grain(images: np.ndarray) -> float:
    """The mean over images [n, H, W, 3] (uint8 or [-1, 1]) of the median absolute 4-neighbour Laplacian of the
    pixels in [0, 1], averaged over channels: 0 for flat regions, whatever the objects' edges (a median)."""
    x = viz.to_uint8(images).astype(np.int32)  # integer levels: a flat region is exactly 0
    c = x[:, 1:-1, 1:-1]
    lap = np.abs(4 * c - x[:, :-2, 1:-1] - x[:, 2:, 1:-1] - x[:, 1:-1, :-2] - x[:, 1:-1, 2:]).mean(-1)
    return float(np.median(lap.reshape(len(x), -1), axis=1).mean() / 255.0)


class Evaluator:
    """Scores weights of the model `graphdef` of `cfg` on `n_images` held-out captions, noise from `seed`.

    Args:
      cfg: the run's config (its `sample` section fixes the sampler, steps and guidance; `data` the captions).
      graphdef: the model's graph (from `nnx.split`).
      n_images: held-out captions (and real images for the distances) to score on; 512 for final numbers.
      seed: seed of the sampling noise (the v-loss noise uses seed + 1, the bootstrap and controls seed + 2).
      feature_spec, cache_dir: the feature net (see shapes.get_feature_net); feature_spec=None skips the
        distances (kid*, fd_shapes).
      dinov2_path: converted DINOv2 file for fd_dinov2 (None: skipped); dinov2_pool: "cls" or "mean".
      batch: images sampled per call (bounds memory).
      mesh: mesh to run the sampler under (the params' mesh), or None.
      n_boot: bootstrap resamples of the captions (0: no intervals).
      with_controls: score the control sets (once, at construction).
      reader: the alignment reader's thresholds.
      split: the caption set (pipeline.eval_dataset): "unseen" (compositions the training never showed: the
        default where the data holds some out) or "seen" (training-like captions the run never read).
    """

    def __init__(
        self,
        cfg,
        graphdef,
        n_images: int,
        seed: int,
        *,
        feature_spec: shapes.FeatureSpec | None = shapes.DEFAULT_SPEC,
        cache_dir: str | Path | None = None,
        dinov2_path: str | Path | None = None,
        dinov2_pool: str = "cls",
        batch: int = 256,
        mesh=None,
        n_boot: int = 1000,
        with_controls: bool = True,
        reader: alignment.Reader = alignment.DEFAULT_READER,
        split: str | None = None,
    ):
        if cfg.data.name != "synthetic":
            raise ValueError("evaluation needs the procedural dataset (data.name='synthetic'): captions are read back")
        if n_images < 2:
            raise ValueError(f"n_images={n_images}: need at least 2 captions")
        self.cfg, self.seed, self.batch, self.mesh, self.reader = cfg, seed, batch, mesh, reader
        self.split = split or pipeline.eval_splits(cfg.data)[0]
        self.heldout = vloss.eval_batch(cfg, n_images, self.split)
        self.dataset = pipeline.eval_dataset(cfg.data, self.split)
        self.scenes = [self.dataset.scene(int(i)) for i in self.heldout["index"]]
        self.text = {k: self.heldout[k] for k in ("tokens", "text_emb", "text_mask") if k in self.heldout}
        self.noise = sampling.fixed_noise(cfg, n_images, seed)
        self.sample_fn = sampling.make_sampler(cfg, graphdef)
        self.vloss_fn = vloss.make_vloss_fn(cfg, graphdef)
        self.counts = bootstrap.counts(n_images, n_boot, seed + 2) if n_boot else None
        real = viz.to_uint8(self.heldout["image"])
        self.feature_fn = self.feature_info = None
        if feature_spec is not None:
            net, self.feature_info = shapes.get_feature_net(feature_spec, cache_dir)
            self.feature_fn = shapes.make_feature_fn(net)
            feats = self.feature_fn(real)
            self.codes = kid.scene_codes(self.scenes)
            self.spaces = {"kid": kid.Space.fit(feats, self.codes), "kid_image": kid.Space.fit(feats)}
            self.real_embedded = {k: self._embed(k, feats) for k in self.spaces}
            self.real_stats = frechet.gaussian_stats(feats)
        self.dino_fn = self.dino_stats = None
        if dinov2_path:
            self.dino_fn = frechet.make_dinov2_fn(dinov2_path, dinov2_pool)
            self.dino_stats = frechet.gaussian_stats(self.dino_fn(real))
        self.fixed_metrics: dict[str, float] = {}
        self.last_checks: dict[str, np.ndarray] = {}  # of the last images scored (image_metrics)
        if with_controls or feature_spec is not None:
            index = self.heldout["index"]  # without the controls only the floor's real images are drawn
            if with_controls:
                sets = controls.control_images(self.dataset, index, seed + 2)
            else:
                sets = {"real": controls.real_images(self.dataset, index)}
            if feature_spec is not None:  # the floors: a second real image per caption, with intervals
                floor = self.image_metrics(sets["real"], alignment_too=False)
                for space in self.spaces:
                    for suffix in ("", "_lo", "_hi"):
                        if space + suffix in floor:
                            self.fixed_metrics[f"{space}_floor{suffix}"] = floor[space + suffix]
            if with_controls:
                for name in controls.NAMES:
                    m = self.image_metrics(sets[name], intervals=False)
                    for key in ("align_overall", "align_exact", "kid", "grain"):
                        if key in m:
                            self.fixed_metrics[f"ctrl_{name}_{key}"] = m[key]

    def _ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _embed(self, space: str, feats: np.ndarray) -> np.ndarray:
        return self.spaces[space].embed(feats, self.codes if space == "kid" else None)

    def generate(self, params) -> np.ndarray:
        """Images for the held-out captions: f32 [n_images, S, S, 3] in [-1, 1]."""
        out = []
        key = jax.random.key(self.seed)
        progress = Progress("sampling evaluation images", len(self.noise))
        with self._ctx():
            for i in range(0, len(self.noise), self.batch):
                text = {k: v[i : i + self.batch] for k, v in self.text.items()}
                out.append(
                    np.asarray(jax.device_get(self.sample_fn(params, text, self.noise[i : i + self.batch], key)))
                )
                progress(i + len(out[-1]))
        return np.concatenate(out)

    def checks(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """Per-image caption checks of images for the held-out captions (alignment.check_batch)."""
        return alignment.check_batch(alignment.read_batch(images, self.reader), self.scenes)

    def image_metrics(self, images: np.ndarray, intervals: bool = True, alignment_too: bool = True) -> dict:
        """The metrics of images [n_images, S, S, 3] (uint8 or [-1, 1]) for the held-out captions that need no
        weights: alignment, KID (both spaces), FD, with bootstrap intervals when `intervals` and n_boot > 0."""
        images = np.asarray(images)
        if len(images) != len(self.scenes):
            raise ValueError(f"{len(images)} images for {len(self.scenes)} held-out captions")
        out: dict[str, float] = {}
        samples: dict[str, np.ndarray] = {}
        w = self.counts if intervals and self.counts is not None else None
        if alignment_too:
            checks = self.last_checks = self.checks(images)
            out.update(alignment.summarize(checks))
            if w is not None:
                samples.update(bootstrap.alignment_samples(checks, w))
        out["grain"] = grain(images)
        if self.feature_fn is not None:
            feats = self.feature_fn(viz.to_uint8(images))
            for space in self.spaces:
                x = self._embed(space, feats)
                out[space] = kid.kid(x, self.real_embedded[space])
                if w is not None:
                    samples[space] = kid.kid_resampled(x, self.real_embedded[space], w)
            out["fd_shapes"] = frechet.frechet_distance(*frechet.gaussian_stats(feats), *self.real_stats)
        if self.dino_fn is not None:
            dino = frechet.gaussian_stats(self.dino_fn(images))
            out["fd_dinov2"] = frechet.frechet_distance(*dino, *self.dino_stats)
        return bootstrap.with_intervals(out, samples)

    def __call__(self, params, images: np.ndarray | None = None) -> dict[str, float]:
        """All metrics of `params` (or of given `images` [n_images,S,S,3] in [-1, 1], for the image metrics)."""
        t0 = time.perf_counter()
        images = self.generate(params) if images is None else images
        out = self.image_metrics(images)
        with self._ctx():
            out.update(
                vloss.heldout_vloss(
                    self.cfg, params, None, len(self.noise), self.seed + 1, fn=self.vloss_fn, batch=self.heldout
                )
            )
        out.update(self.fixed_metrics)
        out["eval_s"] = time.perf_counter() - t0
        return out


def evaluate(cfg, params, graphdef, n_images: int, seed: int, **kwargs) -> dict[str, float]:
    """One-off evaluation of `params` (see the module docstring for the metrics); `kwargs` go to `Evaluator`."""
    return Evaluator(cfg, graphdef, n_images, seed, **kwargs)(params)

"""Held-out v-loss: the model's own flow-matching loss (`diffusion.loss_terms`) on held-out samples, at fixed
times t and fixed noise, so two checkpoints (or two methods) are scored on exactly the same inputs.

Held-out samples are the last indices of the dataset (as for the trainer's sample grid). The times default to
t in {0.1, 0.3, 0.5, 0.7, 0.9} (t = 1 is clean): at t <= 0.9 the clamp (1 - t) >= t_eps of x-prediction does not
bite for t_eps <= 0.1, so x-, v- and eps-predicting models are measured on the same v-space target x - noise.
A weak signal on its own (docs/recipe.md section 7): low v-loss does not imply good samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reve_jax import diffusion, latent
from reve_jax.batch import model_shape
from reve_jax.data import pipeline

DEFAULT_TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)


def eval_batch(cfg, n: int, split: str = "unseen") -> dict[str, np.ndarray]:
    """The first `n` samples of evaluation split `split` of `cfg.data` (pipeline.eval_dataset: never in the training
    stream): {"image" f32 [n,S,S,3] in [-1,1], "index", and the text inputs}."""
    ds = pipeline.eval_dataset(cfg.data, split)
    if not 0 < n <= ds.num_samples:
        raise ValueError(f"need 0 < n={n} <= data.num_samples={ds.num_samples}")
    idx = np.arange(n, dtype=np.int64)
    images = np.asarray(diffusion.to_unit(np.stack([ds[int(i)]["image"] for i in idx])))
    text = pipeline.text_inputs_of(ds, idx, cfg.text.max_len, cfg.text.encoder == "precomputed")
    return {"image": images, "index": idx, **text}


def fixed_inputs(shape: tuple[int, ...], times: Sequence[float], noise_scale: float, seed: int):
    """Noise f32 [len(times), *shape] (noise_scale * N(0, 1), one draw per time) and times f32 [len(times)]."""
    rng = np.random.default_rng(seed)
    noise = noise_scale * rng.standard_normal((len(times), *shape))
    return noise.astype(np.float32), np.asarray(times, np.float32)


def vloss_per_time(apply: Callable, images, text, noise, times, dcfg) -> jax.Array:
    """Mean loss over the batch at each time: f32 [len(times)].

    apply(z [B,S,S,3], t [B], text) -> the network output (x, v or eps per `dcfg.prediction`); images f32
    [B,S,S,3]; noise [T,B,S,S,3] already scaled; times [T]; dcfg: the config's `diffusion` section.
    """

    def one(noise_t, t):
        tb = jnp.full((images.shape[0],), t, jnp.float32)
        z = diffusion.interpolate(images, noise_t, tb)
        per_sample, _ = diffusion.loss_terms(apply(z, tb, text), images, noise_t, z, tb, dcfg)
        return per_sample.mean()

    return jax.lax.map(lambda a: one(*a), (noise, times))


def make_vloss_fn(cfg, graphdef) -> Callable:
    """Jitted fn(params, images, text, noise, times) -> f32 [T], for the model `graphdef` of `cfg` (captions on,
    no routing: the model as it samples). In a latent-space run the images are encoded first and the loss is
    the latents' (noise in the model's shape, batch.model_shape)."""
    dcfg = cfg.diffusion
    codec = latent.codec(cfg)

    def fn(params, images, text, noise, times, ae_params=None):
        model = nnx.merge(graphdef, params)
        if codec is not None:
            images = codec.encode(ae_params, images)

        def apply(z, t, txt):
            out, _ = model(z, t, txt, drop=jnp.zeros((z.shape[0],), bool))
            return out

        return vloss_per_time(apply, images, text, noise, times, dcfg)

    jitted = jax.jit(fn)
    if codec is None:
        return jitted
    return lambda params, images, text, noise, times: jitted(params, images, text, noise, times, codec.params)


def heldout_vloss(
    cfg,
    params,
    graphdef,
    n: int,
    seed: int,
    times: Sequence[float] = DEFAULT_TIMES,
    fn=None,
    batch=None,
    split: str = "unseen",
) -> dict[str, float]:
    """Held-out v-loss of `params` on the first `n` samples of evaluation split `split`, noise from `seed`. `fn`
    (from make_vloss_fn) and `batch` (from eval_batch) may be passed to reuse them. Returns {"vloss": mean over
    times, "vloss_t<t>": per time}."""
    batch = eval_batch(cfg, n, split) if batch is None else batch
    fn = make_vloss_fn(cfg, graphdef) if fn is None else fn
    shape = (len(batch["image"]), *model_shape(cfg, batch["image"].shape[1:3]))
    noise, ts = fixed_inputs(shape, times, cfg.diffusion.noise_scale, seed)
    text = {k: batch[k] for k in ("tokens", "text_emb", "text_mask") if k in batch}
    per_t = np.asarray(jax.device_get(fn(params, batch["image"], text, noise, ts)), np.float64)
    out = {"vloss": float(per_t.mean())}
    out.update({f"vloss_t{t:g}": float(v) for t, v in zip(times, per_t, strict=True)})
    return out

"""Flow matching in pixel space, JiT convention: t = 1 is the clean image, t = 0 pure noise.

    z_t = t * x + (1 - t) * e,   e = noise_scale * eps,   v = dz/dt = x - e = (x - z_t) / (1 - t)

The network predicts x, v or eps (`diffusion.prediction`); every prediction converts to the other two, so the
loss can be measured in any space (`diffusion.loss_space`). JiT's default is x-prediction with the loss in
v-space, where divisions by (1 - t) are clamped at `t_eps`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from reve_jax.config import CHOICES


def to_unit(image):
    """Pixels uint8 [0, 255] -> float32 [-1, 1] (numpy or jax arrays); floating inputs are taken as already in
    [-1, 1] and only cast. The data pipeline ships uint8 (a quarter of the bytes to copy and batch on the host) and
    the train step converts on the device. Division (not multiplication by 2/255) keeps 0 -> -1 and 255 -> 1
    exact."""
    if image.dtype == jnp.uint8:
        return image.astype(jnp.float32) / jnp.float32(127.5) - jnp.float32(1.0)
    return image.astype(jnp.float32)


def _bcast(t: jax.Array, x: jax.Array) -> jax.Array:
    return t.reshape(t.shape + (1,) * (x.ndim - t.ndim))


def sample_t(key: jax.Array, batch: int, cfg) -> jax.Array:
    """Training times [B] in (0, 1): logit-normal(t_mean, t_std) or uniform, a share `t_uniform_frac` uniform,
    then the resolution shift (s > 1 moves mass towards noise, as for larger images)."""
    k_ln, k_u, k_mix = jax.random.split(key, 3)
    uniform = jax.random.uniform(k_u, (batch,), minval=1e-5, maxval=1 - 1e-5)
    if cfg.t_sampler == "logit_normal":
        t = jax.nn.sigmoid(cfg.t_mean + cfg.t_std * jax.random.normal(k_ln, (batch,)))
        if cfg.t_uniform_frac > 0:
            t = jnp.where(jax.random.uniform(k_mix, (batch,)) < cfg.t_uniform_frac, uniform, t)
    else:
        t = uniform
    return shift_t(t, cfg.t_shift)


def shift_t(t: jax.Array, shift: float) -> jax.Array:
    """Resolution shift in the clean-is-1 convention: noise level (1-t) -> s(1-t) / (1 + (s-1)(1-t))."""
    if shift == 1.0:
        return t
    noise = 1.0 - t
    return 1.0 - shift * noise / (1.0 + (shift - 1.0) * noise)


def interpolate(x: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
    """z_t = t x + (1 - t) noise, with `noise` already scaled by noise_scale."""
    tb = _bcast(t, x)
    return tb * x + (1.0 - tb) * noise


def to_x_v(out: jax.Array, z: jax.Array, t: jax.Array, prediction: str, t_eps: float):
    """Network output -> (x_hat, v_hat). Divisions by t or (1 - t) are clamped at t_eps."""
    tb = _bcast(t, z)
    if prediction == "x":
        x_hat = out
        v_hat = (x_hat - z) / jnp.maximum(1.0 - tb, t_eps)
    elif prediction == "v":
        v_hat = out
        x_hat = z + (1.0 - tb) * v_hat
    elif prediction == "eps":
        x_hat = (z - (1.0 - tb) * out) / jnp.maximum(tb, t_eps)
        v_hat = x_hat - out
    else:
        raise ValueError(f"diffusion.prediction={prediction!r} is not one of ('x', 'v', 'eps')")
    return x_hat, v_hat


def loss_terms(out, x, noise, z, t, cfg) -> tuple[jax.Array, jax.Array]:
    """Per-sample flow-matching loss [B] in `cfg.loss_space`, and x_hat (for perceptual losses)."""
    x_hat, v_hat = to_x_v(out, z, t, cfg.prediction, cfg.t_eps)
    tb = _bcast(t, x)
    if cfg.loss_space == "x":
        pred, target = x_hat, x
    elif cfg.loss_space == "v":
        if cfg.prediction == "x":  # JiT: the same clamp on target and prediction
            target = (x - z) / jnp.maximum(1.0 - tb, cfg.t_eps)
        else:
            target = x - noise
        pred = v_hat
    else:
        pred = (z - tb * x_hat) / jnp.maximum(1.0 - tb, cfg.t_eps) if cfg.prediction != "eps" else out
        target = noise
    err = jnp.square(pred.astype(jnp.float32) - target.astype(jnp.float32))
    return err.reshape(err.shape[0], -1).mean(-1), x_hat


# A denoiser maps (z, t [B], cond: bool) -> v_hat; samplers integrate dz/dt = v from t=0 to t=1.
VelocityFn = Callable[[jax.Array, jax.Array], jax.Array]


def time_grid(steps: int, shift: float) -> jax.Array:
    """Integration times 0 = t_0 < ... < t_steps = 1, spaced uniformly then resolution-shifted."""
    return shift_t(jnp.linspace(0.0, 1.0, steps + 1), shift)


def cfg_velocity(v_cond: jax.Array, v_uncond: jax.Array, t: jax.Array, scale: float, interval) -> jax.Array:
    """Classifier-free guidance v_u + s (v_c - v_u), applied only for t inside `interval` (JiT)."""
    lo, hi = interval
    inside = _bcast((t >= lo) & (t <= hi), v_cond)
    return jnp.where(inside, v_uncond + scale * (v_cond - v_uncond), v_cond)


def sample(velocity: VelocityFn, noise: jax.Array, steps: int, sampler: str, shift: float = 1.0) -> jax.Array:
    """Integrate from z_0 = noise to t = 1 with Euler or Heun (Heun's correction on every step but the last: v at
    t = 1 is never evaluated). `velocity(z, t[B])` returns v_hat. Returns the final z (the image)."""
    if sampler not in CHOICES["sample.sampler"]:
        raise ValueError(f"sample.sampler={sampler!r} is not one of {CHOICES['sample.sampler']}")
    ts = time_grid(steps, shift)
    b = noise.shape[0]

    def euler(z, i):
        v = velocity(z, jnp.full((b,), ts[i]))
        return z + (ts[i + 1] - ts[i]) * v, v

    def step(z, i):
        z_euler, v = euler(z, i)
        if sampler == "euler":
            return z_euler, None
        v_next = velocity(z_euler, jnp.full((b,), ts[i + 1]))
        return z + (ts[i + 1] - ts[i]) * 0.5 * (v + v_next), None

    z, _ = jax.lax.scan(step, noise, jnp.arange(steps - 1))
    return euler(z, steps - 1)[0]


def downsample(images: jax.Array, factor: int) -> jax.Array:
    """Average-pool [B, H, W, C] by `factor`: linear, so the pooled z_t is the interpolation of the pooled x and
    noise (the DDT encoder's low-resolution flow)."""
    b, h, w, c = images.shape
    return images.reshape(b, h // factor, factor, w // factor, factor, c).mean(axis=(2, 4))


def ema_decay(decay: float, updates: jax.Array, warmup_power: float) -> jax.Array:
    """The decay of the `updates`-th EMA update (1 for the first): min(decay, (1 - 1/n)^(1 + warmup_power)).

    Early in training a fixed decay keeps the initial weights in the average for 1/(1 - decay) steps (at 0.998,
    67% of the step-200 EMA is the initial weights). The warm-up follows Karras et al.'s power-function EMA,
    whose weight on past iterates grows as their step^warmup_power (about the last 1/(1 + warmup_power) of
    training), until that average is longer than the fixed decay's. warmup_power < 0 switches it off."""
    if warmup_power < 0:
        return jnp.asarray(decay, jnp.float32)
    n = jnp.maximum(updates.astype(jnp.float32), 1.0)
    return jnp.minimum(decay, (1.0 - 1.0 / n) ** (1.0 + warmup_power))


def ema_update(ema, params, decay):
    """One EMA step in fp32: ema <- decay * ema + (1 - decay) * params."""
    return jax.tree.map(lambda e, p: e + (1.0 - decay) * (p.astype(e.dtype) - e), ema, params)

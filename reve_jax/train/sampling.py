"""Sampling from a trained DiT: classifier-free guidance on an interval of t, Euler or Heun, and routed
self-guidance (TREAD's routed model as the weak branch)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reve_jax import diffusion, latent
from reve_jax.batch import model_shape
from reve_jax.data import tokenizer
from reve_jax.train.objective import model_params

__all__ = [
    "Restored",
    "encode_prompts",
    "fixed_noise",
    "make_sampler",
    "model_params",
    "render_from_checkpoint",
    "restore_for_sampling",
]


def encode_prompts(prompts: list[str], max_len: int) -> dict:
    """Captions -> the model's text inputs for the built-in tokenizer."""
    tokens, mask = tokenizer.encode_batch(prompts, max_len)
    return {"tokens": tokens, "text_mask": mask}


def prompt_inputs(cfg, prompts: list[str]) -> dict:
    """The model's text inputs for new prompts: the built-in tokenizer's, or (text.encoder='precomputed') the
    embeddings of the frozen encoder the run's data was prepared with (text.frozen_encoder, its weights from
    text.frozen_encoder_path), padded to text.max_len."""
    t = cfg.text
    if t.encoder == "builtin":
        return encode_prompts(prompts, t.max_len)
    if not t.frozen_encoder:
        raise ValueError(
            "this run was trained on precomputed text embeddings but its config does not say which encoder made "
            "them: pass --config.text.frozen_encoder=<name> (and text.frozen_encoder_path for t5, t5gemma, qwen)"
        )
    from reve_jax.text_encoders import load_encoder

    enc = load_encoder(t.frozen_encoder, t.frozen_encoder_path or None, max_len=t.max_len)
    out = enc.encode(list(prompts))
    if out.emb.shape[-1] != t.emb_dim:
        raise ValueError(
            f"{t.frozen_encoder} gives {out.emb.shape[-1]}-wide embeddings; the run has text.emb_dim={t.emb_dim}"
        )
    return {"text_emb": out.emb.astype(np.float32), "text_mask": out.mask}


def make_sampler(cfg, graphdef, *, steps=None, cfg_scale=None, sampler=None, route_guidance=None):
    """Returns a jitted fn(params, text, noise, key) -> images [B,H,W,3] in [-1,1]. Unset arguments come from
    `cfg.sample`. Guidance uses one batched call of 2B (cond, uncond) per evaluation. `noise` has the model's
    shape (`fixed_noise`); in a latent-space run the generated latents are decoded by the run's autoencoder."""
    s = cfg.sample
    steps = steps or s.steps
    scale = s.cfg_scale if cfg_scale is None else cfg_scale
    sampler = sampler or s.sampler
    route_s = s.route_guidance if route_guidance is None else route_guidance
    dcfg = cfg.diffusion
    guided = scale != 1.0
    # x-prediction's velocity (x_hat - z) / max(1 - t, t_eps): the sampler's own clamp (sample.t_eps, 0 = exact: an
    # Euler step to t = 1 lands on x_hat), or training's (-1), which under-steps every step from t > 1 - t_eps on
    t_eps = s.t_eps if dcfg.prediction == "x" and s.t_eps >= 0 else dcfg.t_eps

    codec = latent.codec(cfg)

    def fn(params, text, noise, key, ae_params=None):
        model = nnx.merge(graphdef, params)
        b = noise.shape[0]
        if guided:
            text2 = jax.tree.map(lambda a: jnp.concatenate([a, a], axis=0), text)
            drop = jnp.concatenate([jnp.zeros((b,), bool), jnp.ones((b,), bool)])
        else:
            text2, drop = text, jnp.zeros((b,), bool)

        def velocity(z, t):
            zz = jnp.concatenate([z, z], 0) if guided else z
            tt = jnp.concatenate([t, t], 0) if guided else t
            out, _ = model(zz, tt, text2, drop=drop)
            _, v = diffusion.to_x_v(out, zz, tt, dcfg.prediction, t_eps)
            if route_s:
                # Routed self-guidance: the routed model is the weak branch, out = routed + s (full - routed).
                out_r, _ = model(zz, tt, text2, drop=drop, route_key=jax.random.fold_in(key, 0))
                _, v_r = diffusion.to_x_v(out_r, zz, tt, dcfg.prediction, t_eps)
                v = v_r + route_s * (v - v_r)
            if guided:
                return diffusion.cfg_velocity(v[:b], v[b:], t, scale, s.cfg_interval)
            return v

        x = diffusion.sample(velocity, noise, steps, sampler, dcfg.t_shift)
        if codec is not None:
            x = codec.decode(ae_params, x)
        return jnp.clip(x, -1.0, 1.0)

    jitted = jax.jit(fn)
    if codec is None:
        return jitted
    return lambda params, text, noise, key: jitted(params, text, noise, key, codec.params)


def fixed_noise(cfg, n: int, seed: int | None = None, hw: tuple[int, int] | None = None) -> np.ndarray:
    """The evaluation noise [n, h, w, c] in the model's space (batch.model_shape) for images of shape `hw`
    (default data.image_size squared): the same for every checkpoint of a run, so sample grids are comparable."""
    rng = np.random.default_rng(cfg.sample.seed if seed is None else seed)
    return (cfg.diffusion.noise_scale * rng.standard_normal((n, *model_shape(cfg, hw)))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A run's weights for sampling: its saved config, the model's graph, the parameters (the first EMA, or the raw
    model weights), the checkpoint's step and the mesh they are sharded over."""

    cfg: Any
    graphdef: Any
    params: Any
    step: int
    mesh: Any


def restore_for_sampling(workdir, step: int | None = None, *, use_ema: bool = True) -> Restored:
    """Checkpoint `step` of `workdir` (default: the newest that loads) with the config saved beside it, restored
    without the loss networks (LPIPS, DINOv2, the autoencoder's encoder are not needed to sample, and their files
    may have moved since the run). The one restore behind scripts/sample.py, scripts/evaluate.py and the
    benchmark's guidance sweep."""
    from pathlib import Path

    from reve_jax import checkpoint, config, sharding
    from reve_jax.train import train_state

    workdir = Path(workdir)
    ckpt = checkpoint.Checkpointer(workdir, reader=True)
    try:
        steps = ckpt.steps()
        if not steps:
            raise checkpoint.CheckpointError(f"no checkpoint in {workdir / 'checkpoints'}: train first")
        if step is not None and step not in steps:
            raise checkpoint.CheckpointError(f"no checkpoint of step {step} in {workdir}; there are {steps}")
        cfg = config.from_json(ckpt.restore_meta(step if step is not None else steps[-1])["config"])
        mesh = sharding.make_mesh(cfg.mesh)
        setup = train_state.make_setup(cfg, mesh, frozen=False)
        if step is None:
            state, meta = ckpt.restore_latest(setup.abstract_state)
        else:
            state, meta = ckpt.restore(step, setup.abstract_state)
    finally:
        ckpt.close()
    params = state["ema"]["ema0"] if use_ema else model_params(state["params"])
    return Restored(cfg, setup.graphdef, params, int(meta["step"]), mesh)


def render_from_checkpoint(
    workdir, prompts, *, out=None, steps=None, cfg_scale=None, sampler=None, seed=0, use_ema=True
):
    """Restore the newest checkpoint of `workdir` (restore_for_sampling) and write a grid of one image per prompt
    to `out` (default <workdir>/samples/cli.png). Returns the PNG path."""
    from pathlib import Path

    from reve_jax import viz

    r = restore_for_sampling(workdir, use_ema=use_ema)
    text = prompt_inputs(r.cfg, list(prompts))
    fn = make_sampler(r.cfg, r.graphdef, steps=steps, cfg_scale=cfg_scale, sampler=sampler)
    noise = fixed_noise(r.cfg, len(prompts), seed)
    with jax.set_mesh(r.mesh):
        images = np.asarray(jax.device_get(fn(r.params, text, noise, jax.random.key(seed))))
    out = Path(out) if out else Path(workdir) / "samples" / "cli.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    viz.save_sample_grid(out, images, [f"{p} (step {r.step})" for p in prompts])
    return out

"""Latent diffusion: the frozen autoencoder a latent run diffuses in, and the codec that the train step, the
samplers and the evaluator share (training it, its cache and the reconstruction check: training.py; the network:
autoencoder.py).

With `latent.path` set, the diffusion model works on the autoencoder's normalised latents: the batch still carries
uint8 pixels (batch.py), the train step encodes them with the frozen encoder (its FLOPs are counted in
flops.py), and every sampler decodes what the model generates back to pixels. See docs/latent.md.

    python scripts/train_autoencoder.py --config configs/speedup/cpu.py:latent --out weights/ae_cpu.npz
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax.latent import autoencoder

log = logging.getLogger("reve_jax")


def enabled(cfg) -> bool:
    return bool(cfg.latent.path)


def ae_config(cfg) -> autoencoder.AEConfig:
    lt = cfg.latent
    return autoencoder.AEConfig(
        channels=lt.channels, downsample=lt.downsample, width=lt.width, res_blocks=lt.res_blocks
    )


def load(cfg) -> autoencoder.Autoencoder:
    """The run's autoencoder; its architecture must match the latent section (channels, downsample)."""
    model, meta = autoencoder.load(cfg.latent.path)
    got, want = model.cfg, ae_config(cfg)
    if (got.channels, got.downsample) != (want.channels, want.downsample):
        raise ValueError(
            f"{cfg.latent.path} holds an autoencoder with {got.channels} channels and downsample {got.downsample}, "
            f"but latent.channels={want.channels}, latent.downsample={want.downsample}: set them to match the file"
        )
    return model


class Codec:
    """The frozen autoencoder as jit arguments: `encode(params, x)` / `decode(params, z)` inside jitted code,
    with `params` the state from `split` (pass it as an argument; closing over it would bake it in)."""

    def __init__(self, model: autoencoder.Autoencoder):
        self.graphdef, state = nnx.split(model)
        self.params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(state))
        self.cfg = model.cfg

    def _model(self, params):
        return nnx.merge(self.graphdef, jax.tree.map(jax.lax.stop_gradient, params))

    def encode(self, params, x: jax.Array) -> jax.Array:
        return self._model(params).encode(x)

    def decode(self, params, z: jax.Array) -> jax.Array:
        return self._model(params).decode(z)


def codec(cfg) -> Codec | None:
    """The run's codec, or None for a pixel-space run."""
    return Codec(load(cfg)) if enabled(cfg) else None

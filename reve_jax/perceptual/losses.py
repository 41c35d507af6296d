"""Perceptual losses on the predicted clean image: pure functions returning one value per sample, so the
caller can weight or gate them by the timestep.

The networks are frozen: every parameter passes through `jax.lax.stop_gradient`, so gradients reach only the
images, and the parameters need no optimizer state. In a jitted train step, pass the network's state as an
argument and merge it inside (`graphdef, state = nnx.split(load_lpips(path))` once, then
`lpips_loss(nnx.merge(graphdef, state), x_hat, x)`), rather than closing over the module, which would bake
the weights into the compiled program as constants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax.perceptual.dinov2 import DinoV2
from reve_jax.perceptual.vgg_lpips import LPIPS


def frozen(module: nnx.Module) -> nnx.Module:
    """A copy of module whose parameters are wrapped in stop_gradient (no gradient flows into them)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(jax.lax.stop_gradient, state))


def resize(x: jax.Array, height: int, width: int) -> jax.Array:
    """Antialiased bilinear resize of NHWC images to [B, height, width, C]; identity at the same size."""
    if x.shape[1:3] == (height, width):
        return x
    return jax.image.resize(x, (x.shape[0], height, width, x.shape[3]), method="linear", antialias=True)


def lpips_loss(lpips_module: LPIPS, x_hat: jax.Array, x: jax.Array, downscale: float = 0.5) -> jax.Array:
    """LPIPS between the prediction and the clean image, per sample.

    x_hat, x: [B, H, W, 3] in [-1, 1]; both are resized by `downscale` (antialiased bilinear) first.
    x is the target: its features carry no gradient and are computed in a separate pass so that the
    backward pass covers x_hat only. Returns [B] float32.
    """
    net = frozen(lpips_module)
    h, w = round(x.shape[1] * downscale), round(x.shape[2] * downscale)
    f_hat = net.features(resize(x_hat, h, w))
    f_ref = jax.lax.stop_gradient(net.features(resize(x, h, w)))
    return net.distance_from_features(f_hat, f_ref)


def dino_loss(dino_module: DinoV2, x_hat: jax.Array, x: jax.Array, size: int = 224) -> jax.Array:
    """1 - cosine similarity between DINOv2 patch tokens of the prediction and of the clean image, averaged
    over tokens, per sample.

    x_hat, x: [B, H, W, 3] in [-1, 1], resized to size x size (antialiased bilinear). x's tokens carry no
    gradient. Returns [B] float32.
    """
    net = frozen(dino_module)
    t_hat = net(resize(x_hat, size, size)).patch
    t_ref = jax.lax.stop_gradient(net(resize(x, size, size)).patch)
    eps = 1e-8
    cos = jnp.sum(t_hat * t_ref, -1) / (
        jnp.maximum(jnp.linalg.norm(t_hat, axis=-1), eps) * jnp.maximum(jnp.linalg.norm(t_ref, axis=-1), eps)
    )
    return jnp.mean(1.0 - cos, axis=-1)

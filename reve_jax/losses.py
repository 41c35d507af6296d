"""Losses on the predicted image besides flow matching: LPIPS and DINOv2 on x_hat (gated on t), and REPA's
alignment of an intermediate block's tokens to DINOv2 features of the clean image.

The frozen networks' weights enter the jitted train step as an argument (`frozen`), replicated over the mesh;
closing over them would bake hundreds of MB into the compiled program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from reve_jax.perceptual import losses as perceptual
from reve_jax.perceptual import weights


@dataclasses.dataclass
class FrozenNets:
    """Graph definitions (static) and parameter states (arrays, passed to the step) of the frozen networks."""

    graphdefs: dict
    states: dict


def load_frozen(cfg, mesh) -> FrozenNets:
    """Load the networks the configured losses need (none when all weights are 0), replicated on `mesh`."""
    lo = cfg.loss
    dtype = jnp.dtype(lo.perceptual_dtype)
    modules = {}
    if lo.lpips_weight > 0:
        modules["lpips"] = weights.load_lpips(lo.lpips_path, dtype=dtype)
    if lo.dino_weight > 0 or lo.repa_weight > 0:
        dino = weights.load_dinov2(lo.dino_path, dtype=dtype)
        width = dino.cfg.width
        if lo.repa_weight > 0 and width != lo.repa_dim:
            raise ValueError(
                f"loss.repa_dim={lo.repa_dim} but the DINOv2 file {lo.dino_path} has width {width}: "
                f"set --config.loss.repa_dim={width}"
            )
        modules["dino"] = dino
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdefs, states = {}, {}
    for name, module in modules.items():
        graphdefs[name], state = nnx.split(module)
        host = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
        states[name] = jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, replicated, lambda idx, a=a: a[idx]), host
        )
    return FrozenNets(graphdefs, states)


def _cosine_distance(a: jax.Array, b: jax.Array) -> jax.Array:
    """1 - cos over the last axis, in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    na = jnp.maximum(jnp.linalg.norm(a, axis=-1), 1e-8)
    nb = jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-8)
    return 1.0 - jnp.sum(a * b, -1) / (na * nb)


def repa_targets(dino, x: jax.Array, size: int, grid: tuple[int, int]) -> jax.Array:
    """DINOv2 patch tokens of the clean image, resampled onto the DiT's token grid: [B, gh*gw, D], no gradient."""
    feats = perceptual.frozen(dino)(perceptual.resize(x, size, size)).patch
    b, n, d = feats.shape
    g = int(round(n**0.5))
    feats = feats.reshape(b, g, g, d)
    if (g, g) != grid:
        feats = jax.image.resize(feats, (b, *grid, d), method="linear", antialias=True)
    return jax.lax.stop_gradient(feats.reshape(b, grid[0] * grid[1], d))


def extra_terms(cfg, graphdefs: dict, states: dict, x_hat, x, t, aux, grid: tuple[int, int]) -> dict:
    """Weighted scalar loss terms: `loss_lpips`, `loss_dino` (gated to t >= loss.perceptual_t_min) and
    `loss_repa`. `grid` is the DiT's token grid (for REPA targets)."""
    lo = cfg.loss
    terms = {}
    gate = (t >= lo.perceptual_t_min).astype(jnp.float32)
    if "lpips" in states:
        net = nnx.merge(graphdefs["lpips"], states["lpips"])
        per = perceptual.lpips_loss(net, x_hat, x, lo.lpips_downscale)
        terms["loss_lpips"] = lo.lpips_weight * jnp.mean(gate * per)
    if "dino" in states:
        net = nnx.merge(graphdefs["dino"], states["dino"])
        if lo.dino_weight > 0:
            per = perceptual.dino_loss(net, x_hat, x, lo.dino_size)
            terms["loss_dino"] = lo.dino_weight * jnp.mean(gate * per)
        if lo.repa_weight > 0:
            target = repa_targets(net, x, lo.dino_size, grid)
            idx = aux["repa_idx"]
            target = jnp.take_along_axis(target, idx[..., None], axis=1)  # the kept tokens when routed
            terms["loss_repa"] = lo.repa_weight * jnp.mean(_cosine_distance(aux["repa"], target))
    return terms

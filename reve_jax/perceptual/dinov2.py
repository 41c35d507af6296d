"""DINOv2 ViT (Oquab et al. 2023; registers: Darcet et al. 2024) as a frozen feature extractor in Flax NNX.

Patch embedding (conv, stride = patch), a CLS token, learned position embeddings for CLS + patches (resampled
bicubically for other image sizes), optional register tokens placed after CLS without position embeddings,
pre-LN blocks (attention and a GELU MLP, each scaled by LayerScale), a final LayerNorm.

Images are NHWC float in [-1, 1]; the ImageNet mean/std normalisation happens inside. Parameters are float32;
`dtype` sets the compute dtype of the matrix multiplies, while the residual stream, LayerNorms and the softmax
stay float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class DinoV2Config:
    """Architecture of a DINOv2 ViT. `pos_grid` is the side of the square grid the position embeddings were
    trained for (37 for the released models: 518 px / 14). `interpolate_antialias` and `interpolate_offset`
    select how those embeddings are resampled (see `cubic_resize_matrix`): the released register models use
    (True, 0.0); the hub's models without registers (False, 0.1); transformers' Dinov2Model (False, 0.0)."""

    width: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    patch_size: int = 14
    pos_grid: int = 37
    num_register_tokens: int = 0
    layer_norm_eps: float = 1e-6
    interpolate_antialias: bool = False
    interpolate_offset: float = 0.0


PRESETS = {
    "vits14": DinoV2Config(width=384, depth=12, num_heads=6, mlp_dim=1536),
    "vitb14": DinoV2Config(width=768, depth=12, num_heads=12, mlp_dim=3072),
    "vits14_reg": DinoV2Config(
        width=384, depth=12, num_heads=6, mlp_dim=1536, num_register_tokens=4, interpolate_antialias=True
    ),
    "vitb14_reg": DinoV2Config(
        width=768, depth=12, num_heads=12, mlp_dim=3072, num_register_tokens=4, interpolate_antialias=True
    ),
}


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter a, evaluated at |x|."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def cubic_resize_matrix(n_in: int, n_out: int, *, antialias: bool, offset: float = 0.0) -> np.ndarray:
    """[n_out, n_in] matrix M so that M @ v resamples v as torch's `F.interpolate(mode="bicubic",
    align_corners=False)` does along one axis.

    antialias=False: Keys kernel a=-0.75, four taps, indices clamped at the borders.
    antialias=True: Keys kernel a=-0.5 stretched by the downscale factor, weights renormalised over the taps
    that fall inside the input (torch's `antialias=True`, as PIL).
    offset > 0 reproduces the DINOv2 hub's `scale_factor=(n_out + offset) / n_in` call: the output size is
    unchanged but the sampling positions use that scale.
    """
    scale = n_in / (n_out + offset)  # input pixels per output pixel
    m = np.zeros((n_out, n_in), np.float64)
    if not antialias:
        for i in range(n_out):
            src = scale * (i + 0.5) - 0.5
            base = math.floor(src)
            t = src - base
            w = _cubic(np.array([t + 1, t, 1 - t, 2 - t]), -0.75)
            for k in range(4):
                m[i, min(max(base - 1 + k, 0), n_in - 1)] += w[k]
        return m
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        j = np.arange(lo, hi)
        w = _cubic((j - center + 0.5) * inv, -0.5)
        if w.sum() != 0:
            w = w / w.sum()
        m[i, lo:hi] = w
    return m


class DinoFeatures(NamedTuple):
    """Outputs after the final LayerNorm, float32: cls [B, D], patch [B, h*w, D] in row-major grid order."""

    cls: jax.Array
    patch: jax.Array


class Attention(nnx.Module):
    def __init__(self, cfg: DinoV2Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        # q, k, v fused in one projection, as in the hub checkpoints ([q; k; v] along the output axis).
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.proj = nnx.Linear(cfg.width, cfg.width, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads), 3, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0], preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits / math.sqrt(d // self.num_heads), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v[:, :, 0]).reshape(b, n, d)
        return self.proj(out)


class Block(nnx.Module):
    def __init__(self, cfg: DinoV2Config, dtype: jnp.dtype, rngs: nnx.Rngs):
        ln = dict(epsilon=cfg.layer_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        lin = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm1 = nnx.LayerNorm(cfg.width, **ln)
        self.attn = Attention(cfg, dtype, rngs)
        self.ls1 = nnx.Param(jnp.ones((cfg.width,), jnp.float32))
        self.norm2 = nnx.LayerNorm(cfg.width, **ln)
        self.fc1 = nnx.Linear(cfg.width, cfg.mlp_dim, **lin)
        self.fc2 = nnx.Linear(cfg.mlp_dim, cfg.width, **lin)
        self.ls2 = nnx.Param(jnp.ones((cfg.width,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.ls1[...] * self.attn(self.norm1(x)).astype(jnp.float32)
        # Exact (erf) GELU, as torch's nn.GELU() default used by both reference implementations.
        h = self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=False))
        return x + self.ls2[...] * h.astype(jnp.float32)


class DinoV2(nnx.Module):
    """DINOv2 ViT feature extractor. Call on NHWC images in [-1, 1]; returns `DinoFeatures`."""

    def __init__(self, cfg: DinoV2Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        p, d = cfg.patch_size, cfg.width
        self.patch_embed = nnx.Conv(
            3, d, (p, p), strides=(p, p), padding="VALID", dtype=dtype, param_dtype=jnp.float32, rngs=rngs
        )
        init = nnx.initializers.normal(0.02)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, d), jnp.float32))
        self.pos_embed = nnx.Param(init(rngs.params(), (1, 1 + cfg.pos_grid**2, d), jnp.float32))
        self.register_tokens = (
            nnx.Param(init(rngs.params(), (1, cfg.num_register_tokens, d), jnp.float32))
            if cfg.num_register_tokens
            else None
        )
        self.blocks = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.depth)])
        self.norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)

    def position_embeddings(self, h: int, w: int) -> jax.Array:
        """Position embeddings [1, 1 + h*w, D] for an h x w patch grid (resampled when it differs from the
        trained grid; the resampling matrices are numpy constants since all sizes are static)."""
        pos = self.pos_embed[...]
        g = self.cfg.pos_grid
        if (h, w) == (g, g):
            return pos
        kw = dict(antialias=self.cfg.interpolate_antialias, offset=self.cfg.interpolate_offset)
        mh = jnp.asarray(cubic_resize_matrix(g, h, **kw), jnp.float32)
        mw = jnp.asarray(cubic_resize_matrix(g, w, **kw), jnp.float32)
        grid = pos[0, 1:].reshape(g, g, -1)
        grid = jnp.einsum("ip,jq,pqd->ijd", mh, mw, grid, precision=jax.lax.Precision.HIGHEST)
        return jnp.concatenate([pos[:, :1], grid.reshape(1, h * w, -1)], axis=1)

    def __call__(self, x: jax.Array) -> DinoFeatures:
        """x: [B, H, W, 3] in [-1, 1]; H and W are floored to multiples of the patch size (as the conv does).
        Returns `DinoFeatures(cls [B, D], patch [B, (H//p)*(W//p), D])`, float32, after the final norm."""
        mean = jnp.asarray(IMAGENET_MEAN, jnp.float32)
        std = jnp.asarray(IMAGENET_STD, jnp.float32)
        x = ((x.astype(jnp.float32) + 1.0) * 0.5 - mean) / std
        patches = self.patch_embed(x)
        b, h, w, d = patches.shape
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, d))
        tokens = jnp.concatenate([cls, patches.reshape(b, h * w, d).astype(jnp.float32)], axis=1)
        tokens = tokens + self.position_embeddings(h, w)
        if self.register_tokens is not None:
            regs = jnp.broadcast_to(self.register_tokens[...], (b, self.cfg.num_register_tokens, d))
            tokens = jnp.concatenate([tokens[:, :1], regs, tokens[:, 1:]], axis=1)
        for block in self.blocks:
            tokens = block(tokens)
        tokens = self.norm(tokens)
        return DinoFeatures(cls=tokens[:, 0], patch=tokens[:, 1 + self.cfg.num_register_tokens :])

"""The pixel-space text-to-image DiT: bottleneck patch embedding, adaLN-Zero blocks (RMSNorm, qk-norm, SwiGLU,
2D RoPE), caption tokens joined to image tokens in attention, optional TREAD routing and a REPA hook.

The sequence is [image tokens, text tokens] so that valid keys form a prefix of every row: attention takes
per-sample key lengths (cuDNN's fast path) instead of a dense mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax.model import routing
from reve_jax.model.layers import (
    Attention,
    PatchEmbed,
    RMSNorm,
    SwiGLU,
    TimeEmbed,
    dense,
    grid_positions,
    rope_angles,
    swiglu_hidden,
    unpatchify,
)
from reve_jax.model.text import TextConditioner


def _dtype(name: str):
    return jnp.dtype(name)


class DiTBlock(nnx.Module):
    """adaLN-Zero transformer block: the conditioning vector sets shift/scale/gate of both sub-layers; the gates
    start at zero so every block starts as the identity."""

    def __init__(self, width: int, heads: int, mlp_hidden: int, *, qk_norm, eps, impl, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm1 = RMSNorm(width, eps=eps, scale=False)
        self.attn = Attention(width, heads, qk_norm=qk_norm, eps=eps, impl=impl, **kw)
        self.norm2 = RMSNorm(width, eps=eps, scale=False)
        self.mlp = SwiGLU(width, mlp_hidden, **kw)
        self.adaln = dense(width, 6 * width, ("embed", "adaln"), init=nnx.initializers.zeros_init(), **kw)

    def __call__(self, x: jax.Array, c: jax.Array, angles: jax.Array, lengths: jax.Array) -> jax.Array:
        mod = self.adaln(jax.nn.silu(c))[:, None, :]
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, angles, lengths)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class FinalLayer(nnx.Module):
    def __init__(self, width: int, out_dim: int, *, eps, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm = RMSNorm(width, eps=eps, scale=False)
        self.adaln = dense(width, 2 * width, ("embed", "adaln"), init=nnx.initializers.zeros_init(), **kw)
        self.linear = dense(width, out_dim, ("embed", "patch"), init=nnx.initializers.zeros_init(), **kw)

    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        shift, scale = jnp.split(self.adaln(jax.nn.silu(c))[:, None, :], 2, axis=-1)
        return self.linear(self.norm(x) * (1 + scale) + shift)


class DiT(nnx.Module):
    """Maps (noisy image z [B,H,W,3], time t [B], caption) to the network output [B,H,W,3] in float32.

    `cfg` is the full run config (model, text and data sections are read). `vocab_size` sizes the built-in
    tokenizer's embedding (ignored for precomputed text embeddings).
    """

    def __init__(self, cfg, vocab_size: int, *, rngs: nnx.Rngs):
        m = cfg.model
        dtype, param_dtype = _dtype(m.dtype), _dtype(m.param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.patch = m.patch
        self.image_size = cfg.data.image_size
        self.head_dim = m.width // m.heads
        self.rope_theta = m.rope_theta
        self.remat = m.remat
        self.repa_block = m.repa_block
        self.route = m.route.enabled
        self.route_keep_ratio = m.route.keep_ratio
        self.route_start, self.route_end = (
            routing.route_span(m.depth, m.route.start, m.route.end) if self.route else (0, 0)
        )

        self.patch_embed = PatchEmbed(m.patch, m.width, m.bottleneck, **kw)
        self.time_embed = TimeEmbed(m.width, **kw)
        self.text = TextConditioner(cfg, vocab_size, m.width, **kw)
        hidden = swiglu_hidden(m.width, m.mlp_ratio, m.mlp_multiple_of)
        self.blocks = nnx.List(
            [
                DiTBlock(m.width, m.heads, hidden, qk_norm=m.qk_norm, eps=m.norm_eps, impl=m.attention, **kw)
                for _ in range(m.depth)
            ]
        )
        self.final = FinalLayer(m.width, m.patch * m.patch * 3, eps=m.norm_eps, **kw)

    def condition(self, t: jax.Array, text: dict, drop: jax.Array | None):
        """Time + caption -> (conditioning vector c [B, W], text tokens [B, L, W], text lengths [B])."""
        txt, lengths, pooled = self.text(text, drop)
        c = self.time_embed(t) + pooled
        return c, txt, lengths

    def __call__(
        self,
        z: jax.Array,
        t: jax.Array,
        text: dict,
        *,
        drop: jax.Array | None = None,
        route_key: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """Returns (output [B,H,W,3] float32, aux). `route_key` turns TREAD on (training, or routed guidance);
        aux holds `repa` (image tokens after block `repa_block`, the kept ones when routed) and `repa_idx`
        (their token indices [B, n])."""
        b, h, w, _ = z.shape
        x = self.patch_embed(z)
        n = x.shape[1]
        c, txt, lengths = self.condition(t, text, drop)
        pos = jnp.broadcast_to(grid_positions(h, w, self.patch)[None], (b, n, 2))
        txt_angles = jnp.zeros((b, txt.shape[1], self.head_dim // 2), jnp.float32)

        def angles_for(p):
            return jnp.concatenate([rope_angles(p, self.head_dim, self.rope_theta), txt_angles], axis=1)

        routed = self.route and route_key is not None
        idx = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
        full_img, angles = None, angles_for(pos)
        aux = {}
        block_fn = nnx.remat(lambda blk, *a: blk(*a)) if self.remat == "block" else (lambda blk, *a: blk(*a))
        for i, block in enumerate(self.blocks):
            if routed and i == self.route_start:
                keep = routing.keep_count(n, self.route_keep_ratio)
                idx = routing.sample_keep_indices(route_key, b, n, keep)
                full_img, x = x, routing.gather_tokens(x, idx)
                angles = angles_for(routing.gather_tokens(pos, idx))
            if routed and i == self.route_end:
                x = routing.scatter_tokens(full_img, x, idx)
                idx = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
                angles = angles_for(pos)
            n_img = x.shape[1]
            seq = jnp.concatenate([x, txt.astype(x.dtype)], axis=1)
            seq = block_fn(block, seq, c, angles, lengths + n_img)
            x, txt = seq[:, :n_img], seq[:, n_img:]
            if i == self.repa_block:
                aux["repa"], aux["repa_idx"] = x, idx
        if routed and self.route_end == len(self.blocks):
            x = routing.scatter_tokens(full_img, x, idx)
        out = self.final(x, c)
        return unpatchify(out.astype(jnp.float32), self.patch, h, w), aux

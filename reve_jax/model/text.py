"""Text conditioning: the built-in trainable encoder for the synthetic captions, and the projection that turns
either its output or precomputed frozen-encoder embeddings into tokens of the DiT's width.

Caption dropout (for classifier-free guidance) replaces a sample's text by a learned null token, so the
unconditional branch is the same function for the built-in and the precomputed paths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax.model.layers import Attention, RMSNorm, SwiGLU, dense, swiglu_hidden


class TextBlock(nnx.Module):
    """Pre-norm transformer block over caption tokens (no time conditioning, no RoPE: word order is carried by
    learned position embeddings)."""

    def __init__(self, width: int, heads: int, *, eps, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm1 = RMSNorm(width, eps=eps, param_dtype=param_dtype, axis_name=None)
        self.attn = Attention(width, heads, qk_norm=True, eps=eps, impl="xla", **kw)
        self.norm2 = RMSNorm(width, eps=eps, param_dtype=param_dtype, axis_name=None)
        self.mlp = SwiGLU(width, swiglu_hidden(width, 4.0, 16), **kw)

    def __call__(self, x: jax.Array, lengths: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), None, lengths)
        return x + self.mlp(self.norm2(x))


class BuiltinTextEncoder(nnx.Module):
    """A small trainable encoder: token + position embeddings, a few transformer blocks, a final norm."""

    def __init__(self, vocab: int, max_len: int, width: int, depth: int, heads: int, *, eps, rngs, dtype, param_dtype):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            vocab,
            width,
            embedding_init=nnx.with_partitioning(init, ("vocab", None)),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.pos = nnx.Param(nnx.with_partitioning(init, (None, None))(rngs.params(), (max_len, width), param_dtype))
        self.blocks = nnx.List(
            [TextBlock(width, heads, eps=eps, rngs=rngs, dtype=dtype, param_dtype=param_dtype) for _ in range(depth)]
        )
        self.norm = RMSNorm(width, eps=eps, param_dtype=param_dtype, axis_name=None)

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...].astype(self.embed.dtype)[None, : tokens.shape[1]]
        lengths = jnp.maximum(mask.sum(-1), 1).astype(jnp.int32)
        for block in self.blocks:
            x = block(x, lengths)
        return self.norm(x)


@dataclasses.dataclass(frozen=True)
class TextArgs:
    """The caption input: `encoder` "builtin" (tokens through the built-in encoder of width/depth/heads over a
    vocabulary of vocab_size, max_len tokens) or "precomputed" (embeddings of width emb_dim). `pooled`: the mean
    of the caption's features also joins the time embedding that modulates every block; False: the caption reaches
    the image tokens through attention alone."""

    encoder: str = "builtin"
    vocab_size: int = 256
    max_len: int = 32
    width: int = 128
    depth: int = 2
    heads: int = 4
    emb_dim: int = 384
    pooled: bool = True


class TextConditioner(nnx.Module):
    """Caption -> (text tokens [B, L, width], valid lengths [B], pooled vector [B, width] or None when
    `args.pooled` is off).

    Text padding must be at the end of each caption (the mask is a prefix), so the DiT can pass key lengths to
    attention instead of a dense mask (cuDNN's fast path takes lengths).
    """

    def __init__(self, args: TextArgs, width: int, *, eps: float, rngs, dtype, param_dtype, with_encoder: bool = True):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        builtin = args.encoder == "builtin"
        self.encoder = (
            BuiltinTextEncoder(args.vocab_size, args.max_len, args.width, args.depth, args.heads, eps=eps, **kw)
            if builtin and with_encoder
            else None
        )
        in_dim = args.width if builtin else args.emb_dim
        self.in_norm = RMSNorm(in_dim, eps=eps, param_dtype=param_dtype, axis_name=None)
        self.proj = dense(in_dim, width, ("text_embed", "embed"), **kw)
        # Created in this order whatever `pooled` is, so that a default model draws the weights it always drew.
        self.pool_proj = dense(in_dim, width, ("text_embed", "embed"), **kw) if args.pooled else None
        init = nnx.initializers.normal(0.02)
        self.null_token = nnx.Param(init(rngs.params(), (width,), param_dtype))
        self.null_pooled = nnx.Param(init(rngs.params(), (width,), param_dtype)) if args.pooled else None

    def features(self, text: dict) -> jax.Array:
        """Caption features [B, L, D] before projection: the built-in encoder's output or the precomputed ones."""
        if self.encoder is not None:
            return self.encoder(text["tokens"], text["text_mask"])
        return text["text_emb"]

    def __call__(
        self, text: dict, drop: jax.Array | None, feats: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """`feats` (from another conditioner's `features`) skips encoding: the DDT towers share one encoder."""
        mask = text["text_mask"]
        feats = self.features(text) if feats is None else feats
        feats = self.in_norm(feats.astype(self.proj.dtype))
        m = mask[..., None].astype(feats.dtype)
        pooled = None if self.pool_proj is None else self.pool_proj((feats * m).sum(1) / jnp.maximum(m.sum(1), 1.0))
        tokens = self.proj(feats)
        lengths = mask.sum(-1).astype(jnp.int32)
        if drop is not None:
            # A dropped caption becomes one learned null token followed by padding.
            null_seq = jnp.zeros_like(tokens).at[:, 0].set(self.null_token[...].astype(tokens.dtype))
            tokens = jnp.where(drop[:, None, None], null_seq, tokens)
            lengths = jnp.where(drop, 1, lengths)
            if pooled is not None:
                pooled = jnp.where(drop[:, None], self.null_pooled[...].astype(pooled.dtype), pooled)
        # An empty caption still exposes one (zero) token so attention never sees an all-masked row.
        lengths = jnp.maximum(lengths, 1)
        return tokens, lengths, pooled

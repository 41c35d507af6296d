"""Building blocks of the DiT: normalisation, 2D RoPE, attention, SwiGLU, time and patch embeddings.

Every parameter carries logical axis names (see docs/architecture.md); the config maps them to mesh axes.
Compute runs in `dtype` (bf16 by default) with `param_dtype` parameters; norms and softmax statistics run in fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = nnx.initializers.Initializer


def dense(
    din: int,
    dout: int,
    axes: tuple[str | None, str | None],
    rngs: nnx.Rngs,
    *,
    dtype,
    param_dtype,
    use_bias: bool = True,
    init: Initializer | None = None,
) -> nnx.Linear:
    """A Linear layer whose kernel (din, dout) and bias (dout,) carry logical axis names."""
    init = init or nnx.initializers.xavier_uniform()
    return nnx.Linear(
        din,
        dout,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.with_partitioning(init, axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in fp32. `scale=False` gives the parameter-free norm adaLN uses."""

    def __init__(self, dim: int, *, eps: float, scale: bool = True, param_dtype=jnp.float32, axis_name="embed"):
        self.eps = eps
        self.scale = (
            nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), (axis_name,))(None, (dim,), param_dtype))
            if scale
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        if self.scale is not None:
            x = x * self.scale[...].astype(jnp.float32)
        return x.astype(dtype)


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """Angular frequencies for one spatial axis: head_dim/2 channels rotate by row, the other half by column."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    quarter = head_dim // 4
    return 1.0 / (theta ** (jnp.arange(quarter, dtype=jnp.float32) / quarter))


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotation angles [..., S, head_dim/2] for 2D positions [..., S, 2] (row, col) in patch units."""
    freqs = rope_frequencies(head_dim, theta)
    rows = positions[..., 0:1].astype(jnp.float32) * freqs
    cols = positions[..., 1:2].astype(jnp.float32) * freqs
    return jnp.concatenate([rows, cols], axis=-1)


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate channel pairs (i, i + D/2) of x [B, S, H, D] by angles [B, S, D/2] (broadcast over heads)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(dtype)


def attention_impl(name: str) -> str | None:
    """The jax.nn.dot_product_attention implementation: cuDNN on GPU under 'auto', XLA elsewhere."""
    if name == "auto":
        return "cudnn" if jax.default_backend() == "gpu" else "xla"
    return name


class Attention(nnx.Module):
    """Multi-head self-attention with qk-norm and RoPE. q, k and v are separate matrices (Muon treats each alone)."""

    def __init__(self, width: int, heads: int, *, qk_norm: bool, eps: float, impl: str, rngs, dtype, param_dtype):
        self.heads = heads
        self.head_dim = width // heads
        self.impl = impl
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q = dense(width, width, ("embed", "heads"), **kw)
        self.k = dense(width, width, ("embed", "heads"), **kw)
        self.v = dense(width, width, ("embed", "heads"), **kw)
        self.out = dense(width, width, ("heads", "embed"), **kw)
        self.q_norm = RMSNorm(self.head_dim, eps=eps, param_dtype=param_dtype, axis_name=None) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=eps, param_dtype=param_dtype, axis_name=None) if qk_norm else None

    def __call__(self, x: jax.Array, angles: jax.Array | None, kv_lengths: jax.Array | None) -> jax.Array:
        """x [B, S, W]; angles [B, S, D/2] or None; kv_lengths [B] valid keys (a prefix of the sequence)."""
        b, s, _ = x.shape
        shape = (b, s, self.heads, self.head_dim)
        q, k, v = self.q(x).reshape(shape), self.k(x).reshape(shape), self.v(x).reshape(shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=kv_lengths, implementation=attention_impl(self.impl)
        )
        return self.out(o.reshape(b, s, -1))


def swiglu_hidden(width: int, mlp_ratio: float, multiple_of: int) -> int:
    """SwiGLU hidden size: 2/3 of mlp_ratio*width (same FLOPs as a GELU MLP of that ratio), rounded up."""
    hidden = int(round(mlp_ratio * width * 2 / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


class SwiGLU(nnx.Module):
    def __init__(self, width: int, hidden: int, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate = dense(width, hidden, ("embed", "mlp"), **kw)
        self.up = dense(width, hidden, ("embed", "mlp"), **kw)
        self.down = dense(hidden, width, ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def timestep_features(t: jax.Array, dim: int, max_period: float = 10_000.0) -> jax.Array:
    """Sinusoidal features [B, dim] of t in [0, 1] (scaled by 1000 as in DiT, so frequencies cover the range)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = (t.astype(jnp.float32) * 1000.0)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class TimeEmbed(nnx.Module):
    def __init__(self, width: int, *, freq_dim: int = 256, rngs, dtype, param_dtype):
        self.freq_dim = freq_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init=nnx.initializers.normal(0.02))
        self.mlp_in = dense(freq_dim, width, (None, "embed"), **kw)
        self.mlp_out = dense(width, width, (None, "embed"), **kw)

    def __call__(self, t: jax.Array) -> jax.Array:
        return self.mlp_out(jax.nn.silu(self.mlp_in(timestep_features(t, self.freq_dim))))


def patchify(images: jax.Array, patch: int) -> jax.Array:
    """[B, H, W, C] -> [B, (H/p)*(W/p), p*p*C], patches in row-major order."""
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(tokens: jax.Array, patch: int, height: int, width: int) -> jax.Array:
    """Inverse of `patchify`: [B, N, p*p*C] -> [B, H, W, C]."""
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.reshape(b, height // patch, width // patch, patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, height, width, c)


def grid_positions(height: int, width: int, patch: int) -> jax.Array:
    """(row, col) of every patch, [N, 2] int32, row-major like `patchify`."""
    rows, cols = jnp.meshgrid(jnp.arange(height // patch), jnp.arange(width // patch), indexing="ij")
    return jnp.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1).astype(jnp.int32)


class PatchEmbed(nnx.Module):
    """Pixels to tokens. With a bottleneck r > 0: p*p*3 -> r -> width, two linear maps and no nonlinearity
    between (JiT); with r = 0 a single linear map (the DiT baseline)."""

    def __init__(self, patch: int, width: int, bottleneck: int, *, rngs, dtype, param_dtype):
        self.patch = patch
        pdim = patch * patch * 3
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if bottleneck > 0:
            self.proj_in = dense(pdim, bottleneck, ("patch", "bottleneck"), use_bias=False, **kw)
            self.proj_out = dense(bottleneck, width, ("bottleneck", "embed"), **kw)
        else:
            self.proj_in = None
            self.proj_out = dense(pdim, width, ("patch", "embed"), **kw)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = patchify(images, self.patch)
        if self.proj_in is not None:
            x = self.proj_in(x)
        return self.proj_out(x)

"""Building blocks of the DiT: normalisation, 2D RoPE, attention, SwiGLU, time and patch embeddings.

Every parameter carries logical axis names (see docs/architecture.md); the config maps them to mesh axes.
Compute runs in `dtype` (bf16 by default) with `param_dtype` parameters; norms and softmax statistics run in fp32.

Performance (docs/performance.md): q, k, v (and SwiGLU's gate, up) stay separate parameters, because Muon
orthogonalises each matrix alone, but run as one GEMM: their kernels are stacked at run time along a new axis, so
each output column is the same dot product as before and a tensor-parallel split of the heads/mlp axis needs no
communication. Activations worth saving in the backward pass are tagged with `checkpoint_name` for remat policies.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

log = logging.getLogger(__name__)

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


# cuDNN's fused (flash) attention takes half-precision inputs and head dims that are multiples of 8, up to 256 on
# Hopper (128 before); outside that JAX raises, so 'auto' does not ask for it.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 256


def attention_impl(name: str, dtype=None, head_dim: int | None = None) -> str:
    """The jax.nn.dot_product_attention implementation for config value `name` (auto | xla | cudnn).

    'auto' gives 'cudnn' on GPU when the compute `dtype` and `head_dim` (if given) fit cuDNN's flash kernel, and
    'xla' otherwise (CPU, float32 compute, odd head dims). An explicit name is returned as it is."""
    if name != "auto":
        return name
    if jax.default_backend() != "gpu":
        return "xla"
    if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(d) for d in _CUDNN_DTYPES]:
        return "xla"
    if head_dim is not None and (head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM):
        return "xla"
    return "cudnn"


def dot_product_attention(q, k, v, kv_lengths, impl: str) -> jax.Array:
    """jax.nn.dot_product_attention over [B, S, H, D] with per-sample key lengths [B] (or None), using
    `attention_impl(impl, ...)`. Under 'auto', a cuDNN call that JAX rejects while tracing (an unsupported shape,
    dtype or cuDNN version) falls back to the XLA implementation with a warning instead of failing."""
    chosen = attention_impl(impl, q.dtype, q.shape[-1])
    try:
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation=chosen)
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
        if impl != "auto" or chosen != "cudnn":
            raise
        log.warning("cuDNN attention unavailable for q %s %s (%s); using the XLA implementation", q.shape, q.dtype, e)
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="xla")


def stacked_projection(x: jax.Array, layers: tuple[nnx.Linear, ...]) -> jax.Array:
    """One GEMM for several Linear layers that read the same input: x [..., din] -> [..., len(layers), dout].

    Output j equals `layers[j](x)` (same dtype promotion: inputs, kernels and biases cast to the layers' compute
    dtype). The kernels are stacked along a new axis (din, n, dout) rather than concatenated, so a sharded dout
    axis stays sharded without moving data."""
    dtype = layers[0].dtype
    kernel = jnp.stack([layer.kernel[...] for layer in layers], axis=1)
    if dtype is not None:
        x, kernel = x.astype(dtype), kernel.astype(dtype)
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    if layers[0].bias is not None:
        bias = jnp.stack([layer.bias[...] for layer in layers], axis=0)
        y = y + bias.astype(y.dtype)
    return y


class Attention(nnx.Module):
    """Multi-head self-attention with qk-norm and RoPE. q, k and v are separate matrices (Muon treats each alone)
    computed by one stacked GEMM."""

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

    def __call__(
        self, x: jax.Array, angles: jax.Array | None, kv_lengths: jax.Array | None, n_query: int | None = None
    ) -> jax.Array:
        """x [B, S, W]; angles [B, S, D/2] or None; kv_lengths [B] valid keys (a prefix of the sequence).
        `n_query`: only the first n_query tokens ask (output [B, n_query, W]); all S are keys and values."""
        b, s, _ = x.shape
        nq = s if n_query is None else n_query
        if nq == s:
            qkv = stacked_projection(x, (self.q, self.k, self.v))  # [B, S, 3, W]
            qkv = checkpoint_name(qkv.reshape(b, s, 3, self.heads, self.head_dim), "attn_qkv")
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = checkpoint_name(self.q(x[:, :nq]).reshape(b, nq, self.heads, self.head_dim), "attn_q")
            kv = stacked_projection(x, (self.k, self.v))  # [B, S, 2, W]
            kv = checkpoint_name(kv.reshape(b, s, 2, self.heads, self.head_dim), "attn_kv")
            k, v = kv[:, :, 0], kv[:, :, 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = apply_rope(q, angles[:, :nq]), apply_rope(k, angles)
        o = checkpoint_name(dot_product_attention(q, k, v, kv_lengths, self.impl), "attn_out")
        return self.out(o.reshape(b, nq, -1))


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
        gate_up = checkpoint_name(stacked_projection(x, (self.gate, self.up)), "mlp_gate_up")  # [..., 2, hidden]
        return self.down(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])


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


def sincos_position_embedding(positions: jax.Array, width: int, theta: float = 10_000.0) -> jax.Array:
    """Fixed 2D sine-cosine embedding [N, width] of (row, col) positions [N, 2], MAE's formula (used by DiT and
    JiT): the first half of the channels encodes the row, the second the column (MAE has them the other way round),
    each as sin then cos over width/4 frequencies."""
    if width % 4:
        raise ValueError(f"the 2D sine-cosine position embedding needs width divisible by 4, got {width}")
    quarter = width // 4
    omega = 1.0 / (theta ** (jnp.arange(quarter, dtype=jnp.float32) / quarter))
    parts = []
    for axis in (0, 1):
        angle = positions[:, axis : axis + 1].astype(jnp.float32) * omega
        parts += [jnp.sin(angle), jnp.cos(angle)]
    return jnp.concatenate(parts, axis=-1)


def grid_positions(height: int, width: int, patch: int) -> jax.Array:
    """(row, col) of every patch, [N, 2] int32, row-major like `patchify`."""
    rows, cols = jnp.meshgrid(jnp.arange(height // patch), jnp.arange(width // patch), indexing="ij")
    return jnp.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1).astype(jnp.int32)


class PatchEmbed(nnx.Module):
    """Pixels (or latents of `channels` channels) to tokens. With a bottleneck r > 0: p*p*C -> r -> width, two
    linear maps and no nonlinearity between (JiT); with r = 0 a single linear map (the DiT baseline)."""

    def __init__(self, patch: int, width: int, bottleneck: int, *, channels: int = 3, rngs, dtype, param_dtype):
        self.patch = patch
        pdim = patch * patch * channels
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

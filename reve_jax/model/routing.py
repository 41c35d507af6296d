"""TREAD token routing: a random, fixed-size subset of image tokens runs through a span of blocks; the rest wait
and re-enter unchanged where the span ends. Shapes are static (the keep count is fixed), so it jits once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def keep_count(num_tokens: int, keep_ratio: float) -> int:
    """Tokens that go through the routed blocks: at least one, at most all."""
    return max(1, min(num_tokens, int(round(num_tokens * keep_ratio))))


def route_span(depth: int, start: int, end: int) -> tuple[int, int]:
    """Resolve the routed block range [start, end) with negative `end` counting from `depth`."""
    end = end if end >= 0 else depth + end
    if not 0 <= start < end <= depth:
        raise ValueError(
            f"model.route.start={start} and model.route.end resolve to [{start}, {end}) for depth {depth}: "
            "need 0 <= start < end <= depth"
        )
    return start, end


def sample_keep_indices(key: jax.Array, batch: int, num_tokens: int, keep: int) -> jax.Array:
    """Per-sample random subsets [B, keep] of token indices, sorted so kept tokens stay in raster order."""
    scores = jax.random.uniform(key, (batch, num_tokens))
    idx = jnp.argsort(scores, axis=-1)[:, :keep]
    return jnp.sort(idx, axis=-1)


def gather_tokens(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, N, ...] -> x[b, idx[b]] [B, keep, ...]."""
    expand = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, expand, axis=1)


def scatter_tokens(full: jax.Array, kept: jax.Array, idx: jax.Array) -> jax.Array:
    """Write kept [B, keep, D] back into full [B, N, D] at idx; the other tokens keep their values."""
    b = jnp.arange(full.shape[0])[:, None]
    return full.at[b, idx].set(kept.astype(full.dtype))

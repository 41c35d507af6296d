"""Analytic FLOP counts for TFLOP/s and MFU: matmul FLOPs only (2 per multiply-add), forward x3 for training.

Routed blocks (TREAD) are counted at the token count they actually run on. Text tokens ride along in every
block's attention and MLP, so they are counted too.
"""

from __future__ import annotations

from reve_jax.model.layers import swiglu_hidden
from reve_jax.model.routing import keep_count, route_span


def block_flops(tokens: int, width: int, mlp_hidden: int) -> float:
    """Forward FLOPs of one transformer block over `tokens` tokens: q,k,v,out projections, QK^T and AV, SwiGLU."""
    proj = 2 * tokens * 4 * width * width
    attn = 2 * 2 * tokens * tokens * width
    mlp = 2 * tokens * 3 * width * mlp_hidden
    return proj + attn + mlp


def forward_flops_per_image(cfg, routed: bool | None = None) -> float:
    """Forward FLOPs per image of the DiT described by `cfg` (routing as configured unless `routed` is given)."""
    m = cfg.model
    n = (cfg.data.image_size // m.patch) ** 2
    text = cfg.text.max_len
    hidden = swiglu_hidden(m.width, m.mlp_ratio, m.mlp_multiple_of)
    routed = m.route.enabled if routed is None else routed
    start, end = route_span(m.depth, m.route.start, m.route.end) if routed else (0, 0)
    kept = keep_count(n, m.route.keep_ratio)
    total = 0.0
    for i in range(m.depth):
        img = kept if routed and start <= i < end else n
        total += block_flops(img + text, m.width, hidden)
        total += 2 * m.width * 6 * m.width  # adaLN modulation, once per image
    pdim = m.patch * m.patch * 3
    embed = 2 * n * (pdim * m.bottleneck + m.bottleneck * m.width) if m.bottleneck else 2 * n * pdim * m.width
    final = 2 * n * m.width * pdim
    t = cfg.text
    text_enc = 0.0
    if t.encoder == "builtin":
        text_enc = t.depth * block_flops(text, t.width, swiglu_hidden(t.width, 4.0, 16))
    text_proj = 2 * text * (t.width if t.encoder == "builtin" else t.emb_dim) * m.width
    return total + embed + final + text_enc + text_proj


def train_flops_per_image(cfg) -> float:
    """Training FLOPs per image: forward + backward (twice the forward)."""
    return 3.0 * forward_flops_per_image(cfg)

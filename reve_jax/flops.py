"""Analytic FLOP counts for TFLOP/s and MFU: matmul FLOPs only (2 per multiply-add), forward x3 for training; and
the device peak that MFU divides by.

Routed blocks (TREAD) are counted at the token count they actually run on. Text tokens ride along in every
block's attention and MLP, so they are counted too; with `model.text_stream` fixed they are keys and values only.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from reve_jax.batch import image_shape, model_shape
from reve_jax.model.layers import swiglu_hidden  # noqa: F401 (re-exported)
from reve_jax.model.routing import keep_count, route_span


def block_flops(tokens: int, width: int, mlp_hidden: int, keys: int | None = None) -> float:
    """Forward FLOPs of one transformer block updating `tokens` tokens that attend to `keys` tokens (default: the
    same ones): q,out projections and SwiGLU on the updated tokens, k,v projections on the keys, QK^T and AV."""
    keys = tokens if keys is None else keys
    proj = 2 * tokens * 2 * width * width + 2 * keys * 2 * width * width
    attn = 2 * 2 * tokens * keys * width
    mlp = 2 * tokens * 3 * width * mlp_hidden
    return proj + attn + mlp


def _pixels(cfg, hw) -> tuple[int, int]:
    """(h, w) of what the model denoises: the image, or its latents in a latent-space run."""
    return model_shape(cfg, hw)[:2]


def tower_flops(cfg, width, depth, patch, bottleneck, out_patch, context, routed, hw=None) -> float:
    """Forward FLOPs per image of one DiT tower: `context` extra tokens (text, DDT plan) ride in every block (as
    keys and values only under `model.text_stream` fixed). `hw` is the image (H, W), default data.image_size
    squared."""
    m = cfg.model
    h, w = _pixels(cfg, hw)
    n = (h // patch) * (w // patch)
    hidden = swiglu_hidden(width, m.mlp_ratio, m.mlp_multiple_of)
    start, end = route_span(depth, m.route.start, m.route.end) if routed else (0, 0)
    kept = keep_count(n, m.route.keep_ratio)
    total = 0.0
    for i in range(depth):
        img = kept if start <= i < end else n
        updated = img if m.text_stream == "fixed" else img + context
        total += block_flops(updated, width, hidden, keys=img + context)
        total += 2 * width * 6 * width  # adaLN modulation, once per image
    channels = model_shape(cfg, hw)[2]
    pdim = patch * patch * channels
    embed = 2 * n * (pdim * bottleneck + bottleneck * width) if bottleneck else 2 * n * pdim * width
    final = 2 * n * width * out_patch * out_patch * channels
    text_in = cfg.text.width if cfg.text.encoder == "builtin" else cfg.text.emb_dim
    text_proj = 2 * cfg.text.max_len * text_in * width
    return total + embed + final + text_proj


def forward_flops_per_image(cfg, routed: bool | None = None, hw: tuple[int, int] | None = None) -> float:
    """Forward FLOPs per image of the model described by `cfg` (routing as configured unless `routed` is given)
    at image size `hw` (H, W; default data.image_size squared)."""
    m, t = cfg.model, cfg.text
    routed = m.route.enabled if routed is None else routed
    text = t.max_len
    text_enc = t.depth * block_flops(text, t.width, swiglu_hidden(t.width, 4.0, 16)) if t.encoder == "builtin" else 0
    if m.arch != "ddt":
        return text_enc + tower_flops(cfg, m.width, m.depth, m.patch, m.bottleneck, m.patch, text, routed, hw)
    d = m.ddt
    h, w = _pixels(cfg, hw)
    plan = (h // d.enc_patch) * (w // d.enc_patch)
    enc = tower_flops(
        cfg, d.enc_width, d.enc_depth, d.enc_patch, m.bottleneck, d.enc_patch // d.enc_downsample, text, False, hw
    )
    dec = tower_flops(cfg, m.width, m.depth, m.patch, m.bottleneck, m.patch, text + plan, routed, hw)
    return text_enc + enc + dec + 2 * plan * d.enc_width * m.width


def train_flops_per_image(cfg, hw: tuple[int, int] | None = None) -> float:
    """Training FLOPs per image of size `hw` (default data.image_size squared): forward + backward (2x forward),
    plus the frozen encoder's forward pass in a latent-space run (it encodes every training image)."""
    total = 3.0 * forward_flops_per_image(cfg, hw=hw)
    if cfg.latent.path:
        from reve_jax import latent
        from reve_jax.latent.autoencoder import encoder_flops_per_image

        total += encoder_flops_per_image(latent.ae_config(cfg), *image_shape(cfg, hw))
    return total


# Dense bf16 peak per chip, for MFU. A device kind not listed here uses train.peak_tflops or a measured peak.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def measured_matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    """Achieved float32 matmul TFLOP/s of device 0: the peak used for MFU where no datasheet peak is known."""
    x = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def peak_tflops(configured: float) -> tuple[float, str]:
    """Per-device peak TFLOP/s and where it came from: the config, the datasheet, or a measured matmul."""
    if configured > 0:
        return configured, "config"
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops, f"datasheet {name} bf16"
    return measured_matmul_tflops(), "measured f32 matmul"

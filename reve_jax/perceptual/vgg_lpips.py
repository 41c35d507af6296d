"""VGG16 features and the LPIPS distance (Zhang et al. 2018, "v0.1" VGG variant) in Flax NNX.

The layer layout is torchvision's `vgg16().features`: five stages of 3x3 conv + ReLU (2, 2, 3, 3, 3 convs),
a 2x2 max-pool between stages. LPIPS reads the last ReLU of each stage (relu1_2, relu2_2, relu3_3, relu4_3,
relu5_3), so the final max-pool of torchvision's stack is never needed and is left out.

Images are NHWC float in [-1, 1]. Parameters are float32; `dtype` sets the compute dtype of the convolutions
(bf16 on accelerators); everything after a tap (normalisation, heads, means) runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VGG16_CHANNELS = (64, 128, 256, 512, 512)
STAGE_DEPTHS = (2, 2, 3, 3, 3)
TAP_NAMES = ("relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3")

# LPIPS v0.1 "ScalingLayer": maps [-1, 1] images to roughly ImageNet-normalised ones.
LPIPS_SHIFT = (-0.030, -0.088, -0.188)
LPIPS_SCALE = (0.458, 0.448, 0.450)


def torchvision_conv_indices(depths: tuple[int, ...] = STAGE_DEPTHS) -> list[int]:
    """Index N in torchvision's `features.N.weight` of each conv, in order (0, 2, 5, 7, 10, ... 28).

    Each conv is followed by a ReLU (one index) and each stage by a max-pool (one index).
    """
    indices, i = [], 0
    for depth in depths:
        for _ in range(depth):
            indices.append(i)
            i += 2
        i += 1
    return indices


class VGG16Features(nnx.Module):
    """The conv trunk of VGG16. `channels` gives each stage's width: (64, 128, 256, 512, 512) is the real
    network; tests pass narrow widths with the same layout."""

    def __init__(
        self,
        channels: tuple[int, ...] = VGG16_CHANNELS,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if len(channels) != len(STAGE_DEPTHS):
            raise ValueError(f"VGG16 has {len(STAGE_DEPTHS)} stages, got channels={channels}")
        self.channels = tuple(int(c) for c in channels)
        convs, c_in = [], 3
        for width, depth in zip(self.channels, STAGE_DEPTHS, strict=True):
            for _ in range(depth):
                convs.append(
                    nnx.Conv(
                        c_in,
                        width,
                        (3, 3),
                        padding=((1, 1), (1, 1)),
                        dtype=dtype,
                        param_dtype=jnp.float32,
                        rngs=rngs,
                    )
                )
                c_in = width
        self.convs = nnx.List(convs)

    def __call__(self, x: jax.Array) -> list[jax.Array]:
        """x: [B, H, W, 3] (already scaled as the network expects). Returns the five stage taps, each
        [B, H / 2^s, W / 2^s, channels[s]] in float32."""
        taps, k = [], 0
        for stage, depth in enumerate(STAGE_DEPTHS):
            if stage > 0:
                # torch's MaxPool2d(2, 2) floors odd sizes, as VALID padding does.
                x = nnx.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
            for _ in range(depth):
                x = jax.nn.relu(self.convs[k](x))
                k += 1
            taps.append(x.astype(jnp.float32))
        return taps


def _unit_normalise(f: jax.Array, eps: float = 1e-10) -> jax.Array:
    """f / (||f||_channels + eps), as LPIPS's normalize_tensor. The square root is guarded so that a
    position where every channel is zero (common after ReLU) gives a zero gradient instead of NaN."""
    sq = jnp.sum(f * f, axis=-1, keepdims=True)
    positive = sq > 0
    norm = jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)
    return f / (norm + eps)


class LPIPS(nnx.Module):
    """LPIPS with a VGG16 trunk: distance(x0, x1) -> [B].

    Per tap: unit-normalise features over channels, square the difference, weight channels with a learned
    non-negative 1x1 head (no bias), average over space; then sum over the five taps.
    """

    def __init__(
        self,
        channels: tuple[int, ...] = VGG16_CHANNELS,
        *,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.vgg = VGG16Features(channels, dtype=dtype, rngs=rngs)
        # Heads are kept float32: they act on float32 squared differences. Random init is only for tests;
        # real heads come from the lpips package's file (see weights.py). Non-negative like the real ones.
        self.heads = nnx.List(
            [
                nnx.Linear(
                    c,
                    1,
                    use_bias=False,
                    dtype=jnp.float32,
                    param_dtype=jnp.float32,
                    kernel_init=nnx.initializers.uniform(1.0 / c),
                    rngs=rngs,
                )
                for c in self.vgg.channels
            ]
        )

    def features(self, x: jax.Array) -> list[jax.Array]:
        """x: [B, H, W, 3] in [-1, 1]. Returns the five VGG taps (float32) after LPIPS's scaling layer."""
        shift = jnp.asarray(LPIPS_SHIFT, jnp.float32)
        scale = jnp.asarray(LPIPS_SCALE, jnp.float32)
        return self.vgg((x.astype(jnp.float32) - shift) / scale)

    def distance_from_features(self, f0: list[jax.Array], f1: list[jax.Array]) -> jax.Array:
        """Per-sample LPIPS [B] from two lists of taps as returned by `features`."""
        total = 0.0
        for head, a, b in zip(self.heads, f0, f1, strict=True):
            d = jnp.square(_unit_normalise(a) - _unit_normalise(b))
            total = total + jnp.mean(head(d)[..., 0], axis=(1, 2))
        return total

    def __call__(self, x0: jax.Array, x1: jax.Array) -> jax.Array:
        """x0, x1: [B, H, W, 3] in [-1, 1]. Returns LPIPS distance per sample, [B] float32."""
        return self.distance_from_features(self.features(x0), self.features(x1))

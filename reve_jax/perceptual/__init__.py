"""Frozen perceptual networks for losses on the predicted image: VGG16-LPIPS and DINOv2, their weight
conversion from the official PyTorch checkpoints, and the per-sample loss functions."""

from reve_jax.perceptual.dinov2 import PRESETS, DinoFeatures, DinoV2, DinoV2Config, cubic_resize_matrix
from reve_jax.perceptual.losses import dino_loss, frozen, lpips_loss, resize
from reve_jax.perceptual.vgg_lpips import LPIPS, VGG16_CHANNELS, VGG16Features
from reve_jax.perceptual.weights import (
    convert_dinov2,
    convert_lpips,
    dinov2_params_from_torch,
    load_dinov2,
    load_lpips,
    lpips_params_from_torch,
    read_checkpoint,
)

__all__ = [
    "LPIPS",
    "PRESETS",
    "VGG16_CHANNELS",
    "DinoFeatures",
    "DinoV2",
    "DinoV2Config",
    "VGG16Features",
    "convert_dinov2",
    "convert_lpips",
    "cubic_resize_matrix",
    "dino_loss",
    "dinov2_params_from_torch",
    "frozen",
    "load_dinov2",
    "load_lpips",
    "lpips_params_from_torch",
    "lpips_loss",
    "read_checkpoint",
    "resize",
]

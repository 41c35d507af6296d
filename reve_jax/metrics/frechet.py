"""The Fréchet distance between Gaussians fitted to two feature sets, in float64, and the DINOv2 features it
is computed on for FD-DINOv2 (given a converted DINOv2 file)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from reve_jax import diffusion

# ------------------------------------------------------------------------------------------ Fréchet distance


def gaussian_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean float64 [D] and covariance float64 [D, D] (unbiased) of features [N, D], N >= 2."""
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need features [N >= 2, D], got shape {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False).reshape(f.shape[1], f.shape[1])


def _psd_sqrt(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2), in float64:
    |mu1 - mu2|^2 + tr(s1) + tr(s2) - 2 tr((s1^1/2 s2 s1^1/2)^1/2). The symmetric form keeps every matrix
    positive semi-definite, so the square roots are exact eigendecompositions (no complex parts to drop).
    Returns a float >= 0. Biased upwards at small n (prefer KID, kid.py)."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    r1 = _psd_sqrt(s1)
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(r1 @ s2 @ r1), 0.0, None)).sum()
    fd = float(np.square(mu1 - mu2).sum() + np.trace(s1) + np.trace(s2) - 2.0 * cross)
    return max(fd, 0.0)  # rounding (sqrt of ~0 eigenvalues of rank-deficient covariances) can dip below 0


def feature_fd(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets [N, D] and [M, D]."""
    return frechet_distance(*gaussian_stats(feats_a), *gaussian_stats(feats_b))


# ------------------------------------------------------------------------------------------ DINOv2


def make_dinov2_fn(path: str | Path, pool: str = "cls", size: int = 224, batch: int = 64):
    """Features of a converted DINOv2 file (reve_jax.perceptual.load_dinov2): returns fn(images uint8 or float
    [-1, 1], [N,S,S,3]) -> float64 [N, D], images resized to `size` (antialiased bilinear), `pool` = "cls" (the
    class token) or "mean" (mean patch token)."""
    from reve_jax.perceptual import load_dinov2, resize

    if pool not in ("cls", "mean"):
        raise ValueError(f"pool={pool!r}: choose 'cls' or 'mean'")
    graphdef, state = nnx.split(load_dinov2(path))

    @jax.jit
    def fn(st, x):
        x = diffusion.to_unit(x)
        feats = nnx.merge(graphdef, st)(resize(x, size, size))
        return feats.cls if pool == "cls" else feats.patch.mean(axis=1)

    def features(images):
        images = np.asarray(images)
        return np.concatenate(
            [np.asarray(fn(state, images[i : i + batch]), np.float64) for i in range(0, len(images), batch)]
        )

    return features

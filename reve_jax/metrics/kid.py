"""Kernel Inception Distance (Binkowski et al. 2018, "Demystifying MMD GANs") in the project's feature space, with
bootstrap intervals over captions.

KID is the squared maximum mean discrepancy with the cubic polynomial kernel k(x, y) = (x.y / d + 1)^3, estimated
without bias: every mean over pairs leaves out the pairs that share a sample. Unlike the Fréchet distance it has
no positive bias at small n, so two sets of real images score 0 on average (negative values are noise), and its
real-vs-real floor shows how far from 0 a sample of this size lands by chance.

Two spaces (`Space`):

- "image": the feature net's features of the image alone (the marginal distribution of images). Blind, by
  construction, to which caption an image belongs: real images under shuffled captions score the floor;
- "joint" (the default `kid`): the features concatenated with a one-hot encoding of the caption's scene (the
  feature net's targets), so the distance is between distributions of (caption, image) pairs: an image drawn for
  another caption, or with its objects in the wrong cells, is far from the real pairs.

Evaluation sets are paired by caption (generated image i and real image i share caption i). A generated image
and the real image of its own caption are not independent, so the cross term leaves out those pairs as well
(`paired=True`), which keeps the estimate unbiased.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from reve_jax.data import synthetic
from reve_jax.perceptual import shapes


def scene_codes(scenes: list[synthetic.Scene]) -> np.ndarray:
    """One-hot encodings of scenes: background (8) and per cell color, shape, size (with "empty" classes):
    float64 [N, 8 + 9 * (9 + 6 + 3)]."""
    parts = []
    for name, (cells, classes) in shapes.HEADS.items():
        t = np.stack([shapes.scene_targets(s)[name] for s in scenes])  # [N, cells]
        parts.append(np.eye(classes)[t].reshape(len(scenes), cells * classes))
    return np.concatenate(parts, 1)


@dataclasses.dataclass(frozen=True)
class Space:
    """The standardisation of a feature space, fitted on a reference (real) set: features are centered on the
    reference mean and divided by its RMS deviation (one scale for all dimensions, so a dimension that barely
    varies stays small); in the joint space the scene codes get the same treatment, then join the features with
    equal weight. `embed(feats, codes)` gives the vectors the kernel sees."""

    mean: np.ndarray
    scale: float
    code_mean: np.ndarray | None = None
    code_scale: float = 1.0

    @classmethod
    def fit(cls, feats: np.ndarray, codes: np.ndarray | None = None) -> Space:
        """From reference features [N, D] (and scene codes [N, C] for the joint space)."""
        mean = feats.mean(0)
        scale = float(np.sqrt(np.square(feats - mean).sum(1).mean() / feats.shape[1])) or 1.0
        if codes is None:
            return cls(mean, scale)
        code_mean = codes.mean(0)
        # Codes scaled so their mean squared norm equals the features' (D after standardisation).
        code_rms = float(np.sqrt(np.square(codes - code_mean).sum(1).mean())) or 1.0
        return cls(mean, scale, code_mean, code_rms / np.sqrt(feats.shape[1]))

    def embed(self, feats: np.ndarray, codes: np.ndarray | None = None) -> np.ndarray:
        x = (np.asarray(feats, np.float64) - self.mean) / self.scale
        if self.code_mean is None:
            return x
        return np.concatenate([x, (codes - self.code_mean) / self.code_scale], 1)


def poly_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Binkowski et al.'s kernel (x.y / d + 1)^3 between the rows of x [N, d] and y [M, d]: [N, M]."""
    return np.power(x @ y.T / x.shape[1] + 1.0, 3)


def _offdiag_mean(k: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Mean of k[i, j] over pairs of distinct samples of resamples given by counts w [B, N]: [B] (pairs that
    share a sample, itself or a duplicate, are left out)."""
    total = np.einsum("bi,ij,bj->b", w, k, w) - np.square(w) @ np.diag(k)
    pairs = np.square(w.sum(1)) - np.square(w).sum(1)
    return total / np.maximum(pairs, 1.0)


def kid(x: np.ndarray, y: np.ndarray, paired: bool = True) -> float:
    """Unbiased KID between embedded sets x [N, d] and y [M, d]; paired (N == M, row i of each shares a caption):
    the cross term also leaves out the pairs (i, i)."""
    return float(kid_resampled(x, y, np.ones((1, len(x))), paired)[0])


def kid_resampled(x: np.ndarray, y: np.ndarray, w: np.ndarray, paired: bool = True) -> np.ndarray:
    """KID of resamples given by counts w [B, N] (how often each sample is drawn; paired: the same draw of
    captions for both sets, otherwise y is used whole): [B]."""
    if paired and len(x) != len(y):
        raise ValueError(f"paired sets need the same size, got {len(x)} and {len(y)}")
    kxx = _offdiag_mean(poly_kernel(x, x), w)
    if paired:
        kyy = _offdiag_mean(poly_kernel(y, y), w)
        kxy = _offdiag_mean(poly_kernel(x, y), w)
    else:
        kyy = np.full(len(w), _offdiag_mean(poly_kernel(y, y), np.ones((1, len(y))))[0])
        kxy = (w @ poly_kernel(x, y)).sum(1) / (w.sum(1) * len(y))
    return kxx + kyy - 2.0 * kxy

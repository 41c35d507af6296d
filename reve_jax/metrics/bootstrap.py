"""Bootstrap confidence intervals over captions: every metric of an evaluation is recomputed on resamples (with
replacement) of its captions, the same resamples for every metric, and the central 95% of those values is its
interval. A resample is a count vector (how often each caption is drawn), so metrics that are sums over
captions are matrix products."""

from __future__ import annotations

import numpy as np

from reve_jax.data.synthetic import alignment

LEVEL = 0.95


def counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """Counts float64 [n_boot, n] of n_boot resamples (with replacement) of n captions, from `seed`."""
    idx = np.random.default_rng(seed).integers(0, n, (n_boot, n))
    return np.stack([np.bincount(row, minlength=n) for row in idx]).astype(np.float64)


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central `level` percentile interval of bootstrap values."""
    lo, hi = np.percentile(np.asarray(samples, np.float64), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def alignment_samples(checks: dict[str, np.ndarray], w: np.ndarray) -> dict[str, np.ndarray]:
    """The alignment scores (alignment.summarize's keys) of resamples w [B, N] of per-image checks
    (alignment.check_batch): name -> [B]."""
    out = {}
    for a in alignment.ATTRIBUTES:
        out[f"align_{a}"] = (w @ checks[a][:, 0]) / np.maximum(w @ checks[a][:, 1], 1.0)
    out["align_overall"] = np.mean([out[f"align_{a}"] for a in alignment.ATTRIBUTES], axis=0)
    exact = np.all([checks[a][:, 0] == checks[a][:, 1] for a in alignment.ATTRIBUTES], axis=0)
    out["align_exact"] = (w @ exact) / w.sum(1)
    return out


def with_intervals(values: dict[str, float], samples: dict[str, np.ndarray]) -> dict[str, float]:
    """`values` plus "<name>_lo" and "<name>_hi" for every name with bootstrap `samples`."""
    out = dict(values)
    for name, s in samples.items():
        out[f"{name}_lo"], out[f"{name}_hi"] = interval(s)
    return out

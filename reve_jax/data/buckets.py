"""Aspect-ratio buckets with a fixed token budget.

A square resolution R with patch size p gives a budget of (R/p)^2 image tokens. Each bucket is an (H, W) pair,
both multiples of `multiple` (a multiple of the patch size), whose token count H*W/p^2 is the largest that does
not exceed the budget for its aspect ratio. Every bucket therefore costs about the same compute per image, and a
batch drawn from one bucket has a single static shape.

Preparation assigns each image to the bucket nearest its aspect ratio (in log space, so 2:1 and 1:2 are equally
far from 1:1); the reader then draws whole batches from one bucket at a time (see pipeline.BucketOrder).
"""

import math
from collections.abc import Sequence

# Width:height ratios offered by default: landscape, portrait and square shapes common in photo datasets.
DEFAULT_RATIOS: tuple[str, ...] = ("1:1", "5:4", "4:5", "4:3", "3:4", "3:2", "2:3", "16:9", "9:16", "2:1", "1:2")


def parse_ratio(text: str) -> float:
    """ "W:H" (or a plain number) -> width / height as a float > 0; ValueError for anything else."""
    w, sep, h = str(text).partition(":")
    try:
        value = float(w) / float(h) if sep else float(w)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"aspect ratio {text!r}: expected 'W:H' such as '16:9', or a number") from None
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"aspect ratio {text!r} must be positive")
    return value


def make_buckets(
    resolution: int, patch: int, ratios: Sequence[str] = DEFAULT_RATIOS, multiple: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Buckets for a square `resolution` budget: returns sorted unique (height, width) pairs.

    Args:
      resolution: side of the square image whose token count is the budget, (resolution / patch)^2.
      patch: model patch size in pixels.
      ratios: width:height aspect ratios, e.g. ("1:1", "16:9").
      multiple: both sides are multiples of this (default `patch`); must itself be a multiple of `patch`.
    """
    multiple = patch if multiple is None else int(multiple)
    if patch < 1 or multiple < 1 or multiple % patch:
        raise ValueError(f"bucket multiple={multiple} must be a positive multiple of patch={patch}")
    if resolution < multiple or resolution % patch:
        raise ValueError(f"resolution={resolution} must be a multiple of patch={patch} and >= {multiple}")
    area = resolution * resolution
    out = set()
    for text in ratios:
        r = parse_ratio(text)
        # Work on the landscape form (short side first) and transpose portrait ratios at the end, so that W:H
        # and H:W give mirrored buckets.
        wide = max(r, 1.0 / r)
        best = None
        # Try the multiples just below and above the exact short side; the long side is then the largest
        # multiple that keeps the area within the budget (no bucket costs more than the square one). Keep the
        # pair closest to the ratio, then the larger area, then the smaller short side.
        exact = math.sqrt(area / wide) / multiple
        for short in sorted({max(1, math.floor(exact)) * multiple, max(1, math.ceil(exact)) * multiple}):
            long_ = (area // short) // multiple * multiple
            if long_ < short:
                continue
            key = (round(abs(math.log((long_ / short) / wide)), 9), -(short * long_), short)
            if best is None or key < best[0]:
                best = (key, (short, long_))
        if best is not None:
            short, long_ = best[1]
            out.add((short, long_) if r >= 1.0 else (long_, short))
    if not out:
        raise ValueError(f"no bucket fits resolution={resolution} with ratios={tuple(ratios)}")
    return tuple(sorted(out))


def nearest_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest (in log ratio) to a height x width image."""
    target = math.log(width / height)
    errors = [abs(math.log(w / h) - target) for h, w in buckets]
    return min(range(len(buckets)), key=lambda i: (errors[i], i))


def num_tokens(bucket: tuple[int, int], patch: int) -> int:
    """Image tokens of one (height, width) bucket at `patch` pixels per patch side."""
    h, w = bucket
    return (h // patch) * (w // patch)

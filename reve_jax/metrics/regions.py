"""Where a model's images differ from the data, by region around the objects: the KID of a model's images with
one region given back its real pixels. In the fixed rendering every caption has one image, so each generated image
has its real counterpart pixel for pixel; a region whose real pixels bring the KID down to the floor holds what the
feature network tells apart from the data (`scripts/evaluate.py --regions`, docs/evaluation.md).

The regions partition every image, from the caption's real image and its background alone (controls.backgrounds):
- interior: the object's pixels more than one pixel inside its outline;
- rim: the object's outermost pixels (the object less its one-pixel erosion);
- ring: the background pixels touching the object (its one-pixel dilation less the object);
- near: the background two and three pixels away from the object;
- flat: the rest of the background.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from reve_jax import viz
from reve_jax.data.synthetic import controls
from reve_jax.metrics import quality

REGIONS = ("interior", "rim", "ring", "near", "flat")


def masks(real: np.ndarray, background: np.ndarray) -> dict[str, np.ndarray]:
    """The regions (module docstring) of uint8 images [n, S, S, 3] given their backgrounds alone: name -> bool
    [n, S, S], disjoint and covering every pixel."""
    objects = np.any(np.asarray(real) != np.asarray(background), axis=-1)

    def per_image(fn, **kw):
        return np.stack([fn(o, **kw) for o in objects])

    inside = per_image(ndimage.binary_erosion)
    grown1 = per_image(ndimage.binary_dilation)
    grown3 = per_image(ndimage.binary_dilation, iterations=3)
    return {
        "interior": inside,
        "rim": objects & ~inside,
        "ring": grown1 & ~objects,
        "near": grown3 & ~grown1,
        "flat": ~grown3,
    }


def by_region(ev: quality.Evaluator, images: np.ndarray) -> dict[str, dict[str, float]]:
    """For images [n, S, S, 3] (uint8 or [-1, 1]) of the evaluator's held-out captions: {"generated": their KID and
    alignment, <region>: the same with that region's pixels replaced by the real image's, its share of the pixels
    ("frac") and the mean absolute error of the generated pixels there ("abs_err", in levels of 255)}."""
    if ev.cfg.data.render != "fixed":
        raise ValueError(
            f"regions compare each image with its caption's real image: that needs data.render='fixed' (one image "
            f"per caption), not {ev.cfg.data.render!r}"
        )
    if ev.feature_fn is None:
        raise ValueError("regions read KID: build the Evaluator with a feature network (feature_spec)")
    generated = viz.to_uint8(images)
    real = viz.to_uint8(ev.heldout["image"])
    regions = masks(real, controls.backgrounds(ev.dataset, ev.heldout["index"]))
    err = np.abs(generated.astype(np.float32) - real).mean(-1)

    def scores(x):
        m = ev.image_metrics(x, intervals=False)
        return {"kid": m["kid"], "align_overall": m["align_overall"]}

    out = {"generated": scores(generated)}
    for name, mask in regions.items():
        mixed = np.where(mask[..., None], real, generated)
        err_there = float(err[mask].mean()) if mask.any() else 0.0
        out[name] = {**scores(mixed), "frac": float(mask.mean()), "abs_err": err_there}
    return out


def format_table(table: dict[str, dict[str, float]]) -> str:
    """The result of `by_region` as lines: each region's share, error there and KID with its real pixels."""
    g = table["generated"]
    lines = [f"KID {g['kid']:.4f}, alignment {g['align_overall']:.3f}; with one region's real pixels:",
             f"  {'region':9s} {'pixels':>7s} {'|err|':>6s} {'KID':>7s} {'align':>6s}"]  # fmt: skip
    for name in REGIONS:
        r = table[name]
        lines.append(f"  {name:9s} {r['frac']:7.3f} {r['abs_err']:6.1f} {r['kid']:7.4f} {r['align_overall']:6.3f}")
    return "\n".join(lines)

"""The per-object reader (data/synthetic/alignment.py) on its own images at every supported size, under the
degradations docs/evaluation.md documents, and on the controls (data/synthetic/controls.py): each property with a
bound it must meet."""

import time

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

from reve_jax.data import synthetic
from reve_jax.data.synthetic import alignment, controls
from reve_jax.metrics import bootstrap


def _real(size, n, max_objects=3, seed=0):
    ds = synthetic.SyntheticShapes(size, 10**6, seed, max_objects)
    index = np.arange(len(ds) - n, len(ds))
    return ds, index, np.stack([ds[int(i)]["image"] for i in index]), [ds.scene(int(i)) for i in index]


def _noise(images, sigma, seed=0):
    return np.clip(images + np.random.default_rng(seed).normal(0, sigma, images.shape), 0, 255).astype(np.uint8)


def _blur(images, sigma):
    return np.stack([gaussian_filter(x.astype(np.float32), (sigma, sigma, 0)) for x in images]).round().astype(np.uint8)


@pytest.mark.parametrize("size", [16, 24, 32, 64, 128])
def test_every_attribute_reads_right_on_the_datasets_own_images(size):
    _, _, images, scenes = _real(size, 96 if size <= 64 else 48)
    r = alignment.score(images, scenes)
    for a in alignment.ATTRIBUTES:
        assert r[f"align_{a}"] >= 0.99, (size, r)


@pytest.mark.parametrize(
    "size, degrade, floor",
    [
        (32, lambda x: _noise(x, 10), {"align_overall": 0.97}),
        (32, lambda x: _noise(x, 20), {"align_overall": 0.93, "align_position": 0.97, "align_color": 0.97}),
        (128, lambda x: _noise(x, 20), {"align_overall": 0.98}),
        (16, lambda x: _noise(x, 20), {"align_overall": 0.9}),
        (32, lambda x: _blur(x, 0.5), {"align_overall": 0.97}),
        (32, lambda x: np.roll(x, (1, 1), axis=(1, 2)), {"align_overall": 0.97}),
        (32, lambda x: np.roll(x, (2, 2), axis=(1, 2)), {"align_overall": 0.9, "align_position": 0.97}),
        (32, lambda x: np.clip(x.astype(int) + 35, 0, 255).astype(np.uint8), {"align_background": 0.9}),
    ],
    ids=["noise10", "noise20", "noise20_128px", "noise20_16px", "blur0.5", "shift1", "shift2", "tint35"],
)
def test_reader_holds_up_under_the_documented_degradations(size, degrade, floor):
    _, _, images, scenes = _real(size, 64)
    r = alignment.score(degrade(images), scenes)
    for key, least in floor.items():
        assert r[key] >= least, (key, r)


def test_reader_falls_with_heavier_degradation():
    _, _, images, scenes = _real(32, 48)
    noisy = [alignment.score(_noise(images, s), scenes)["align_exact"] for s in (0, 15, 30, 60)]
    blurred = [alignment.score(_blur(images, s), scenes)["align_overall"] for s in (0, 0.7, 1.2, 2.0)]
    for curve in (noisy, blurred):
        assert all(b <= a + 0.02 for a, b in zip(curve, curve[1:], strict=False)), curve
        assert curve[-1] < 0.6 * curve[0], curve


def test_controls_score_clearly_below_real_images():
    ds, index, images, scenes = _real(32, 64)
    sets = controls.control_images(ds, index, seed=0)
    scores = {name: alignment.score(x, scenes) for name, x in sets.items()}
    assert scores["real"]["align_overall"] >= 0.99 and scores["real"]["align_exact"] >= 0.95
    for name in ("shuffled", "background", "one_object"):
        assert scores[name]["align_overall"] <= 0.6, (name, scores[name])
        assert scores[name]["align_exact"] <= 0.25, (name, scores[name])
    assert scores["background"]["align_background"] >= 0.95 and scores["background"]["align_position"] == 0.0
    assert scores["noisy"]["align_overall"] >= 0.95  # pixel noise on the right scene: the checks read scenes
    # One right object in a random cell: its color, shape and size are read right when it lands in its own cell.
    one = scores["one_object"]
    assert 0.0 < one["align_shape"] <= one["align_position"] + 1e-9 < 0.5


def test_controls_with_a_single_object_per_image():
    ds, index, images, scenes = _real(32, 64, max_objects=1)
    sets = controls.control_images(ds, index, seed=1)
    one = alignment.score(sets["one_object"], scenes)
    # The right object somewhere: background and colour-independent checks pass, the cell only by chance (1/9).
    assert one["align_background"] >= 0.95 and one["align_position"] <= 0.3
    assert alignment.score(sets["real"], scenes)["align_overall"] >= 0.99


def test_bootstrap_intervals_cover_the_estimate_and_shrink_with_n():
    _, _, images, scenes = _real(32, 128)
    checks = alignment.check_batch(alignment.read_batch(_noise(images, 25)), scenes)
    point = alignment.summarize(checks)
    widths = []
    for n in (32, 128):
        sub = {a: c[:n] for a, c in checks.items()}
        samples = bootstrap.alignment_samples(sub, bootstrap.counts(n, 400, seed=0))
        lo, hi = bootstrap.interval(samples["align_exact"])
        widths.append(hi - lo)
        if n == 128:
            assert lo <= point["align_exact"] <= hi and hi - lo > 0
            np.testing.assert_allclose(bootstrap.alignment_samples(checks, np.ones((1, n)))["align_shape"],
                                       point["align_shape"])  # fmt: skip
    assert widths[1] < widths[0]


def test_reader_is_a_few_milliseconds_per_image():
    _, _, images, scenes = _real(32, 128)
    alignment.score(images[:8], scenes[:8])  # caches
    t0 = time.process_time()
    alignment.score(images, scenes)
    per_image = (time.process_time() - t0) / len(images)
    assert per_image < 0.02, per_image  # about 2 ms of CPU time per 32 px image; generous for shared machines

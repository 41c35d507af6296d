"""Sample grids and loss plots: PNGs of the expected size, readable from disk."""

import json

import numpy as np
import pytest
from PIL import Image

from reve_jax import viz
from reve_jax.data.synthetic import SyntheticShapes


def test_sample_grid_size_and_pixels(tmp_path):
    ds = SyntheticShapes(32, 100)
    samples = [ds[i] for i in range(5)]
    images = np.stack([s["image"] for s in samples])
    captions = [s["caption"] for s in samples]
    path = tmp_path / "grid.png"
    size = viz.save_sample_grid(path, images, captions)
    with Image.open(path) as im:
        assert im.size == size and im.mode == "RGB"
        grid = np.asarray(im)
    # 5 images -> 3 columns of 32 px upscaled 4x to 128 px, 6 px padding around cells.
    assert size[0] == 3 * (128 + 6) + 6
    assert size[1] > 2 * (128 + 6) + 6  # plus the caption rows
    # Nearest-neighbour upscaling: the first cell is the first image repeated 4x4.
    np.testing.assert_array_equal(grid[6 : 6 + 128, 6 : 6 + 128], images[0].repeat(4, 0).repeat(4, 1))
    # Caption text is drawn (dark pixels) below the first image.
    assert (grid[6 + 128 : 6 + 128 + 20, 6 : 6 + 128] < 100).any()


def test_sample_grid_float_input_cols_and_upscale(tmp_path):
    ds = SyntheticShapes(16, 10)
    images = np.stack([ds[i]["image"] for i in range(4)])
    as_float = images.astype(np.float32) / 127.5 - 1.0
    a = viz.make_sample_grid(images, ["x"] * 4, cols=4, upscale=2)
    b = viz.make_sample_grid(as_float, ["x"] * 4, cols=4, upscale=2)
    assert a.size[0] == 4 * (32 + 6) + 6
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    no_caption = viz.save_sample_grid(tmp_path / "g.png", images, [], cols=2, upscale=1)
    assert no_caption == (2 * (16 + 6) + 6, 2 * (16 + 6) + 6)
    with pytest.raises(ValueError, match="captions"):
        viz.make_sample_grid(images, ["only one"])


def test_loss_plot_from_jsonl_and_list(tmp_path):
    rows = [{"step": s, "loss": 1.0 / (1 + s) + 0.01 * np.sin(s)} for s in range(0, 200, 10)]
    rows.insert(3, {"step": 25, "eval/fid": 3.0})  # a line without the key is skipped
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert viz.save_loss_plot(tmp_path / "a.png", jsonl) == 20
    assert viz.save_loss_plot(tmp_path / "b.png", rows, logy=True) == 20
    for name in ("a.png", "b.png"):
        with Image.open(tmp_path / name) as im:
            assert im.size == (700, 400)
    with pytest.raises(ValueError, match="grad_norm"):
        viz.save_loss_plot(tmp_path / "c.png", rows, key="grad_norm")


def test_ema_smooth():
    np.testing.assert_allclose(viz.ema_smooth(np.full(5, 2.0), 0.9), 2.0)
    # By hand, weight 0.5: (0.5 * 0.5 * 1 + 0.5 * 3) / (0.5 * 0.5 + 0.5) = 7/3; a non-finite value is skipped (its
    # place repeats the last average) and a leading one has no average yet.
    out = viz.ema_smooth(np.array([np.nan, 1.0, np.nan, 3.0, np.inf]), 0.5)
    np.testing.assert_allclose(out, [np.nan, 1.0, 1.0, 7 / 3, 7 / 3])
    # Against the closed form on a noisy ramp: the bias-corrected average of the finite values so far, value j
    # weighted w^(number of finite values after it).
    rng = np.random.default_rng(0)
    values = np.linspace(0, 5, 40) + rng.standard_normal(40)
    values[[3, 17, 18]] = np.nan
    w = 0.8
    expected = []
    for i in range(len(values)):
        seen = values[: i + 1][np.isfinite(values[: i + 1])]
        weights = w ** np.arange(len(seen))[::-1]
        expected.append(np.sum(weights * seen) / np.sum(weights))
    np.testing.assert_allclose(viz.ema_smooth(values, w), expected, rtol=1e-12)

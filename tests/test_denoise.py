"""The denoising probe (reve_jax/metrics/denoise.py): its numbers against a float64 computation for models whose answer
is known (one that returns its input, one that paints the caption's image whatever the input), in x- and
v-prediction, and its run on a real model with its grid and its errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from util import tiny_config

from reve_jax.metrics import denoise, vloss
from reve_jax.train import train_state

TIMES = (0.3, 0.9, 0.99)


def _inputs(n=6, s=8, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1, 1, (n, s, s, 3)).astype(np.float32)
    text = {"tokens": np.arange(n, dtype=np.int32)[:, None]}  # each image's "caption" is its index
    noise, ts = vloss.fixed_inputs(images.shape, TIMES, 1.0, seed + 1)
    return images, text, noise, ts


@pytest.mark.parametrize("prediction", ["x", "v"])
def test_a_model_that_returns_its_input_scores_the_inputs_error(prediction):
    images, text, noise, ts = _inputs()
    dcfg = tiny_config().diffusion
    dcfg.prediction = prediction

    def identity(z, t, txt):  # x_hat = z: out = z for x-prediction, v = (x_hat - z) / (1 - t) = 0 for v
        return z if prediction == "x" else jnp.zeros_like(z)

    got = denoise.mse_per_time(identity, images, text, noise, ts, dcfg)
    x, e = images.astype(np.float64), noise.astype(np.float64)
    want = [np.mean(np.square((1 - t) * (e[i] - x))) for i, t in enumerate(TIMES)]  # z - x = (1 - t)(noise - x)
    for key in ("model", "input", "swapped"):
        np.testing.assert_allclose(np.asarray(got[key]), want, rtol=1e-5, err_msg=key)


def test_a_template_painter_is_told_apart_by_the_caption_swap():
    images, text, noise, ts = _inputs()
    dcfg = tiny_config().diffusion  # x-prediction

    def painter(z, t, txt):  # the caption's image, whatever z holds
        return jnp.asarray(images)[txt["tokens"][:, 0]]

    got = denoise.mse_per_time(painter, images, text, noise, ts, dcfg)
    np.testing.assert_allclose(np.asarray(got["model"]), 0.0, atol=1e-7)
    wrong = np.mean(np.square(np.roll(images, 1, axis=0).astype(np.float64) - images))
    np.testing.assert_allclose(np.asarray(got["swapped"]), wrong, rtol=1e-5)  # at every t, even t = 0.99
    assert float(got["input"][-1]) < wrong / 100  # where its input alone would have been almost right


def test_probe_on_a_model_writes_its_table_and_grid():
    cfg = tiny_config()
    graphdef, params = nnx.split(train_state.build_model(cfg))
    table, grid = denoise.probe(cfg, graphdef, params, TIMES, n=4, seed=0, grid=3)
    s = cfg.data.image_size
    assert grid.shape == ((2 + 2 * len(TIMES)) * s, 3 * s, 3) and np.all(np.abs(grid) <= 1.0)
    for name in ("denoise_mse", "denoise_input_mse", "denoise_swapped_mse"):
        assert all(np.isfinite(table[f"{name}_t{t:g}"]) for t in TIMES)
    # At init the output layer is zero: x_hat = 0 for x-prediction, whatever the input and the caption.
    batch = vloss.eval_batch(cfg, 4)
    zero = float(np.mean(np.square(batch["image"].astype(np.float64))))
    assert table["denoise_mse_t0.99"] == pytest.approx(zero, rel=1e-4)
    assert table["denoise_swapped_mse_t0.99"] == pytest.approx(zero, rel=1e-4)
    assert len(denoise.format_table(table, TIMES).splitlines()) == 1 + len(TIMES)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\)"):
        denoise.probe(cfg, graphdef, params, (0.5, 1.0), n=4)
    cfg.latent.path = "ae.npz"  # a latent-space run: its x_hat is a latent, not an image
    with pytest.raises(ValueError, match="pixel space.*ae.npz"):
        denoise.probe(cfg, graphdef, params, TIMES, n=4)


def test_the_reader_columns_score_the_answers_against_their_captions():
    cfg = tiny_config()
    cfg.data.max_objects = 1
    batch = vloss.eval_batch(cfg, 16)
    clean, other = batch["image"], np.roll(batch["image"], 1, axis=0)  # right images; each another caption's
    got = denoise.read_per_time(cfg, batch["index"], np.stack([clean, other]), (0.0, 0.5), "unseen")
    assert got["denoise_align_overall_t0"] == 1.0 and got["denoise_align_shape_t0"] == 1.0
    assert got["denoise_align_overall_t0.5"] < 0.6  # the reader sees the wrong objects, not just any object
    table = {
        **got,
        **{f"{k}_t{t:g}": 0.0 for k in ("denoise_mse", "denoise_input_mse", "denoise_swapped_mse") for t in (0.0, 0.5)},
    }
    lines = denoise.format_table(table, (0.0, 0.5)).splitlines()
    assert "shape" in lines[0] and lines[1].split()[-1] == "1.00"

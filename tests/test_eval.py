"""The quality metrics (caption alignment, Fréchet distance, held-out v-loss, `evaluate`) and the speedup
benchmark's analysis, on cases with known answers."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from scipy.ndimage import gaussian_filter
from util import tiny_config

from reve_jax import diffusion
from reve_jax.data import pipeline, synthetic
from reve_jax.data.synthetic import alignment, controls
from reve_jax.metrics import frechet, quality, vloss
from reve_jax.perceptual import shapes
from reve_jax.train import train_state

# ------------------------------------------------------------------------------------------ caption alignment


def _dataset(size=32, n=48, max_objects=3, render="jitter"):
    ds = synthetic.SyntheticShapes(size, 10**6, 0, max_objects, render=render)
    return np.stack([ds[i]["image"] for i in range(n)]), [ds.scene(i) for i in range(n)]


def _blur(images, sigma):
    f = images.astype(np.float32)
    return np.stack([gaussian_filter(im, (sigma, sigma, 0)) for im in f]).round().astype(np.uint8) if sigma else images


def _shift_colors(images, s):
    f = images.astype(np.float32)
    return ((1 - s) * f + s * f[..., [1, 2, 0]]).round().astype(np.uint8)


@pytest.mark.parametrize("render", ["jitter", "fixed"])
@pytest.mark.parametrize("size", [16, 24, 32, 64, 128])
def test_alignment_is_perfect_on_the_datasets_own_images(size, render):
    images, scenes = _dataset(size, n=64 if size < 128 else 32, render=render)
    r = alignment.score(images, scenes)
    assert r["align_overall"] >= 0.995 and r["align_exact"] >= 0.97, r
    # The model's float range reads the same.
    assert alignment.score(images.astype(np.float32) / 127.5 - 1.0, scenes) == r


@pytest.mark.parametrize("render", ["jitter", "fixed"])
def test_alignment_flags_exactly_the_wrong_attribute(render):
    ds = synthetic.SyntheticShapes(32, 10**6, 0, 2, render=render)
    scene = ds.scene(3)
    image = ds[3]["image"]
    o = scene.objects[0]
    other_color = next(c for c in synthetic.COLOR_NAMES if c not in (o.color, scene.background))
    other_shape = next(s for s in synthetic.SHAPES if s != o.shape)
    other_size = "small" if o.size == "large" else "large"
    free_cell = next(c for c in range(9) if c not in {p.cell for p in scene.objects})
    for field, value, attrs in [
        ("color", other_color, {"color"}),
        ("shape", other_shape, {"shape"}),
        ("size", other_size, {"size"}),
        ("cell", free_cell, {"position", "color", "shape", "size"}),
    ]:
        wrong = dataclasses.replace(scene, objects=(dataclasses.replace(o, **{field: value}), *scene.objects[1:]))
        checks = alignment.check_image(image, wrong)
        failed = {a for a, v in checks.items() if not v[0]}
        assert failed == attrs, (field, checks)
    extra = dataclasses.replace(scene, objects=(*scene.objects, synthetic.SceneObject("circle", "red", "small", 8)))
    if 8 not in {p.cell for p in scene.objects}:
        assert not alignment.check_image(image, extra)["count"][0]


def test_alignment_is_at_chance_or_below_on_noise():
    images, scenes = _dataset()
    rng = np.random.default_rng(0)
    for noise in (
        rng.integers(0, 256, images.shape).astype(np.uint8),
        np.clip(rng.normal(0, 0.5, images.shape), -1, 1),
    ):
        r = alignment.score(noise, scenes)
        assert r["align_overall"] < 0.2
        for a in alignment.ATTRIBUTES:
            assert r[f"align_{a}"] <= alignment.CHANCE[a] + 0.1, (a, r)


def test_alignment_gives_no_objects_to_noise_around_the_background():
    # A half-trained (or broken) model's samples: the right background color under colored noise. Light grain
    # keeps the background; heavy noise around the right mean color is no solid background; neither holds objects.
    images, scenes = _dataset(n=60)
    rng = np.random.default_rng(1)
    for sigma, background_ok in ((8.0, True), (30.0, None), (60.0, False), (100.0, False)):
        bg = np.stack([np.broadcast_to(synthetic.COLORS[s.background], images.shape[1:]) for s in scenes])
        noisy = np.clip(bg + rng.normal(0, sigma, images.shape), 0, 255).astype(np.uint8)
        r = alignment.score(noisy, scenes)
        if background_ok is not None:
            assert (r["align_background"] >= 0.9) if background_ok else (r["align_background"] <= 0.1), (sigma, r)
        for a in ("count", "position", "color", "shape", "size"):
            assert r[f"align_{a}"] <= 0.05, (sigma, r)


@pytest.mark.parametrize(
    "corrupt, strengths",
    [(_blur, (0.0, 1.0, 1.5, 2.0, 3.0)), (_shift_colors, (0.0, 0.1, 0.2, 0.3, 0.5))],
    ids=["blur", "color_shift"],
)
def test_alignment_falls_monotonically_with_corruption(corrupt, strengths):
    images, scenes = _dataset(n=60)
    overall = [alignment.score(corrupt(images, s), scenes)["align_overall"] for s in strengths]
    assert overall[0] == 1.0
    assert all(b <= a for a, b in zip(overall, overall[1:], strict=False)), overall
    assert overall[-1] < 0.7, overall


# ------------------------------------------------------------------------------------------ Fréchet distance


def _scipy_fd(mu1, s1, mu2, s2):
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(np.square(mu1 - mu2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_frechet_distance_matches_a_float64_reference():
    rng = np.random.default_rng(0)
    d = 12
    a, b = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    s1, s2 = a @ a.T + 0.1 * np.eye(d), b @ b.T + 0.1 * np.eye(d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    assert frechet.frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-9)
    shift = rng.normal(size=d)
    assert frechet.frechet_distance(mu1, s1, mu1 + shift, s1) == pytest.approx(np.square(shift).sum(), rel=1e-9)
    assert frechet.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_scipy_fd(mu1, s1, mu2, s2), rel=1e-8)
    # Rank-deficient covariances (fewer samples than dimensions) stay finite and non-negative.
    f1, f2 = rng.normal(size=(5, d)), rng.normal(size=(7, d)) + 1.0
    fd = frechet.feature_fd(f1, f2)
    assert np.isfinite(fd) and fd > 0
    assert frechet.feature_fd(f1, f1) == pytest.approx(0.0, abs=1e-6)


def _tiny_spec(**kw):
    return shapes.FeatureSpec(
        channels=(4, 8), cell_dim=4, global_dim=4, n_train=64, n_test=16, sizes=(32,), size_weights=(1.0,),
        steps=3, batch=16, **kw
    )  # fmt: skip


FEATURE_NET_SCRIPT = """
import json, sys
import numpy as np
from reve_jax.perceptual import shapes
spec = shapes.FeatureSpec(**json.loads(sys.argv[1]))
out = sys.argv[2]
images = np.load(out + "/images.npy")
m1, info = shapes.get_feature_net(spec, out)
m2, info2 = shapes.get_feature_net(spec, out)  # loaded from the file
m3, _ = shapes.train_feature_net(spec)  # rebuilt from the seed
np.savez(out + "/features.npz", *[np.asarray(shapes.make_feature_fn(m)(images)) for m in (m1, m2, m3)])
json.dump([info, info2], open(out + "/info.json", "w"))
"""


def test_feature_net_is_deterministic_and_cached(tmp_path):
    """In its own process with XLA's default optimisation, as users build the net: under the suite's fast-compile
    flags (conftest) its training reaches NaN at step 2. Its max pooling's gradient divides by the number of
    positions equal to the max, which a fused recompute that XLA codegens differently at -O0 can make zero."""
    spec = _tiny_spec()
    images, _ = _dataset(n=6)
    np.save(tmp_path / "images.npy", images)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-c", FEATURE_NET_SCRIPT, json.dumps(dataclasses.asdict(spec)), str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / f"feature_net_{spec.key()}.npz").exists()
    f1, f2, f3 = np.load(tmp_path / "features.npz").values()
    info, info2 = json.loads((tmp_path / "info.json").read_text())
    assert f1.shape == (6, 9 * 4 + 4) and np.isfinite(f1).all() and np.isfinite(info["final_loss"])
    np.testing.assert_array_equal(f1, f2)
    np.testing.assert_allclose(f1, f3, rtol=1e-5, atol=1e-6)
    assert info == info2
    assert set(info["test_accuracy"]) == {"position", "color", "shape", "size", "empty", "background"}
    assert _tiny_spec(seed=1).key() != spec.key()


# ------------------------------------------------------------------------------------------ held-out v-loss


def _dcfg(prediction):
    return tiny_config(f"diffusion.prediction='{prediction}'").diffusion


def test_vloss_is_zero_for_the_true_prediction_and_grows_with_error():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-1, 1, (4, 8, 8, 3)), jnp.float32)
    noise, times = vloss.fixed_inputs(x.shape, vloss.DEFAULT_TIMES, 1.0, seed=0)
    err = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    for prediction in ("x", "v", "eps"):
        dcfg = _dcfg(prediction)

        def truth(z, t, text, s=0.0, prediction=prediction):
            tb = t[:, None, None, None]
            e = (z - tb * x) / (1 - tb)  # the noise that made z
            out = {"x": x, "v": x - e, "eps": e}[prediction]
            return out + s * err

        losses = [
            float(vloss.vloss_per_time(lambda z, t, txt, s=s: truth(z, t, txt, s), x, {}, noise, times, dcfg).mean())
            for s in (0.0, 0.1, 0.3)
        ]
        assert losses[0] == pytest.approx(0.0, abs=1e-8), prediction
        assert losses[0] < losses[1] < losses[2], (prediction, losses)


def test_heldout_vloss_is_deterministic_for_fixed_seeds():
    cfg = tiny_config()
    model = train_state.build_model(cfg)
    from flax import nnx

    graphdef, params = nnx.split(model)
    # Random weights everywhere: at init the zero output layer makes an x-prediction's v-loss independent of the
    # noise (-z/(1-t) - v = -x/(1-t)), so the seed could not show.
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(params))
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves])
    fn = vloss.make_vloss_fn(cfg, graphdef)
    batch = vloss.eval_batch(cfg, 4)
    np.testing.assert_array_equal(batch["index"], np.arange(4))  # the first samples of the unseen split
    unseen = pipeline.eval_dataset(cfg.data, "unseen")
    np.testing.assert_array_equal(batch["image"][0], diffusion.to_unit(unseen[0]["image"]))
    a = vloss.heldout_vloss(cfg, params, graphdef, 4, seed=3, fn=fn, batch=batch)
    b = vloss.heldout_vloss(cfg, params, graphdef, 4, seed=3, fn=fn, batch=batch)
    c = vloss.heldout_vloss(cfg, params, graphdef, 4, seed=4, fn=fn, batch=batch)
    assert a == b and a != c
    assert set(a) == {"vloss", *(f"vloss_t{t:g}" for t in vloss.DEFAULT_TIMES)}


# ------------------------------------------------------------------------------------------ evaluate


def test_evaluate_returns_every_metric(tmp_path):
    from flax import nnx

    from reve_jax.perceptual import DinoV2, DinoV2Config
    from reve_jax.perceptual.weights import export_dinov2

    cfg = tiny_config("sample.steps=2")
    graphdef, params = nnx.split(train_state.build_model(cfg))
    params = nnx.to_pure_dict(params)
    dcfg = DinoV2Config(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=14, pos_grid=2)
    dino = export_dinov2(DinoV2(dcfg, rngs=nnx.Rngs(0)), dcfg, tmp_path / "dino.npz")
    ev = quality.Evaluator(cfg, graphdef, 6, seed=0, dinov2_path=dino, n_boot=50)  # the checked-in feature net
    out = ev(params)
    names = {"align_overall", "align_exact", "kid", "kid_image", "fd_shapes", "fd_dinov2", "vloss", "eval_s"}
    names |= {f"{m}_{e}" for m in ("align_overall", "align_shape", "kid", "kid_image") for e in ("lo", "hi")}
    names |= {"kid_floor", "kid_floor_lo", "kid_floor_hi", "kid_image_floor"}
    names |= {f"ctrl_{c}_{m}" for c in controls.NAMES for m in ("align_overall", "align_exact", "kid")}
    assert names <= set(out), names - set(out)
    assert all(isinstance(v, float) and np.isfinite(v) for v in out.values())
    assert out["align_overall_lo"] <= out["align_overall"] <= out["align_overall_hi"]
    # Fixed captions, noise and seeds: the same weights score the same.
    again = ev(params)
    assert {k: v for k, v in again.items() if k != "eval_s"} == {k: v for k, v in out.items() if k != "eval_s"}
    # The real images themselves: perfect alignment and zero distances.
    real = ev(params, images=ev.heldout["image"])
    assert real["align_overall"] == 1.0 and real["ctrl_real_align_overall"] == 1.0
    assert real["fd_shapes"] == pytest.approx(0.0, abs=1e-6) and real["fd_dinov2"] == pytest.approx(0.0, abs=1e-6)
    assert real["kid"] == pytest.approx(0.0, abs=1e-9) and real["kid_image"] == pytest.approx(0.0, abs=1e-9)
    # Without the controls (the benchmark's final evaluation): the same floors, no control scored.
    bare = quality.Evaluator(cfg, graphdef, 6, seed=0, dinov2_path=dino, n_boot=50, with_controls=False)
    floors = {k: v for k, v in ev.fixed_metrics.items() if not k.startswith("ctrl_")}
    assert floors and bare.fixed_metrics == floors

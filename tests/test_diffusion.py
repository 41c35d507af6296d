"""Flow matching: conversions between predictions, losses, time sampling, samplers, guidance and EMA."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from reve_jax import diffusion


def _cfg(**kw):
    c = ml_collections.ConfigDict(
        dict(
            prediction="x",
            loss_space="v",
            t_sampler="logit_normal",
            t_mean=-0.8,
            t_std=0.8,
            t_shift=1.0,
            t_uniform_frac=0.0,
            t_eps=0.05,
            noise_scale=1.0,
            caption_drop=0.1,
        )
    )
    c.update(kw)
    return c


def _data(b=16, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(-1, 1, (b, 4, 4, 3)), jnp.float32)
    e = jnp.asarray(scale * rng.standard_normal((b, 4, 4, 3)), jnp.float32)
    t = jnp.asarray(rng.uniform(0.1, 0.9, b), jnp.float32)
    return x, e, t


@pytest.mark.parametrize("prediction", ["x", "v", "eps"])
def test_every_prediction_recovers_x_and_v(prediction):
    x, e, t = _data()
    z = diffusion.interpolate(x, e, t)
    true = {"x": x, "v": x - e, "eps": e}[prediction]
    x_hat, v_hat = diffusion.to_x_v(true, z, t, prediction, 0.05)
    np.testing.assert_allclose(x_hat, x, atol=1e-5)
    np.testing.assert_allclose(v_hat, x - e, atol=1e-5)


@pytest.mark.parametrize("prediction", ["x", "v", "eps"])
@pytest.mark.parametrize("space", ["x", "v", "eps"])
def test_loss_is_zero_at_the_truth_and_positive_elsewhere(prediction, space):
    x, e, t = _data(scale=2.0)
    z = diffusion.interpolate(x, e, t)
    cfg = _cfg(prediction=prediction, loss_space=space, noise_scale=2.0)
    true = {"x": x, "v": x - e, "eps": e}[prediction]
    loss, x_hat = diffusion.loss_terms(true, x, e, z, t, cfg)
    assert loss.shape == (16,) and float(loss.max()) < 1e-8
    np.testing.assert_allclose(x_hat, x, atol=1e-5)
    wrong, _ = diffusion.loss_terms(true + 0.1, x, e, z, t, cfg)
    assert float(wrong.min()) > 1e-4


def test_jit_v_loss_matches_float64_formula():
    x, e, t = _data()
    t = t.at[0].set(0.99)  # inside the clamp
    z = diffusion.interpolate(x, e, t)
    out = x + 0.3
    loss, _ = diffusion.loss_terms(out, x, e, z, t, _cfg())
    x64, z64, o64 = (np.asarray(a, np.float64) for a in (x, z, out))
    d = np.maximum(1 - np.asarray(t, np.float64), 0.05)[:, None, None, None]
    want = (((o64 - z64) / d - (x64 - z64) / d) ** 2).reshape(16, -1).mean(-1)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_logit_normal_time_sampling_and_shift():
    t = diffusion.sample_t(jax.random.key(0), 200_000, _cfg(t_mean=-0.8, t_std=0.8))
    logits = np.log(np.asarray(t) / (1 - np.asarray(t)))
    assert abs(logits.mean() + 0.8) < 0.01 and abs(logits.std() - 0.8) < 0.01
    # Photoroom's 3t/(1+2t) in the noise convention, here on the noise level 1 - t.
    tt = jnp.linspace(0.01, 0.99, 7)
    noise = 1 - tt
    np.testing.assert_allclose(1 - diffusion.shift_t(tt, 3.0), 3 * noise / (1 + 2 * noise), rtol=1e-6)
    mixed = diffusion.sample_t(jax.random.key(1), 100_000, _cfg(t_uniform_frac=0.5, t_mean=3.0, t_std=0.1))
    assert 0.45 < float(jnp.mean(mixed < 0.9)) < 0.55  # half uniform, half concentrated near 0.95


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_samplers_reach_the_data_point_under_the_exact_velocity(sampler):
    target = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (3, 4, 4, 3)), jnp.float32)

    def velocity(z, t):  # the exact flow for a single data point
        return (target - z) / jnp.maximum(1 - t, 1e-3)[:, None, None, None]

    noise = jax.random.normal(jax.random.key(0), target.shape)
    out = diffusion.sample(velocity, noise, 8, sampler)
    np.testing.assert_allclose(out, target, atol=1e-4)


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_an_x_predicting_sampler_lands_on_x_hat_unless_its_velocity_is_clamped(sampler):
    """An x-prediction that is right at every step: the exact velocity (sample.t_eps = 0) lands on it at any step
    count; training's clamp at t_eps = 0.05 under-steps every step that starts past t = 0.95 and leaves noise."""
    target = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (3, 4, 4, 3)), jnp.float32)
    noise = jax.random.normal(jax.random.key(0), target.shape)

    def run(steps, t_eps):
        def velocity(z, t):
            return diffusion.to_x_v(target, z, t, "x", t_eps)[1]

        return diffusion.sample(velocity, noise, steps, sampler)

    for steps in (12, 20, 48):
        np.testing.assert_allclose(run(steps, 0.0), target, atol=1e-5)
    np.testing.assert_allclose(run(20, 0.05), target, atol=1e-5)  # no step starts past t = 0.95
    left = np.abs(np.asarray(run(48, 0.05) - target)).mean() / np.abs(np.asarray(noise - target)).mean()
    assert left > 0.01, left  # the clamped steps leave a share of the noise: 1.4% (Euler), 1.7% (Heun) at 48 steps


def test_the_model_sampler_takes_its_clamp_from_sample_t_eps():
    """sampling.make_sampler reads sample.t_eps for an x-predicting model: at 12 steps (none past t = 0.95) a clamp
    at 0.05 changes nothing; at 24 it changes the images; -1 takes training's clamp."""
    from flax import nnx
    from util import tiny_config

    from reve_jax.train import sampling, train_state

    images = {}
    for steps in (12, 24):
        for t_eps in (0.0, 0.05, -1.0):  # -1: training's clamp, diffusion.t_eps
            cfg = tiny_config("diffusion.prediction='x'", "diffusion.t_eps=0.05", "sample.sampler='euler'",
                              f"sample.t_eps={t_eps}")  # fmt: skip
            graphdef, params = nnx.split(train_state.build_model(cfg))
            text = sampling.prompt_inputs(cfg, ["a small red circle in the center, on a white background"] * 2)
            fn = sampling.make_sampler(cfg, graphdef, steps=steps)
            images[steps, t_eps] = np.asarray(fn(nnx.to_pure_dict(params), text, sampling.fixed_noise(cfg, 2), None))
    np.testing.assert_array_equal(images[12, 0.0], images[12, 0.05])
    assert np.abs(images[24, 0.0] - images[24, 0.05]).max() > 1e-4
    np.testing.assert_array_equal(images[24, -1.0], images[24, 0.05])


def test_heun_is_more_accurate_than_euler_on_a_curved_flow():
    def velocity(z, t):  # dz/dt = -z t: z(1) = z(0) exp(-1/2)
        return -z * t[:, None]

    z0 = jnp.ones((1, 3))
    exact = np.exp(-0.5)
    err_euler = abs(float(diffusion.sample(velocity, z0, 10, "euler")[0, 0]) - exact)
    err_heun = abs(float(diffusion.sample(velocity, z0, 10, "heun")[0, 0]) - exact)
    assert err_heun < err_euler / 5


def test_guidance_only_inside_its_interval():
    vc, vu = jnp.ones((2, 3)), jnp.zeros((2, 3))
    out = diffusion.cfg_velocity(vc, vu, jnp.asarray([0.05, 0.5]), 4.0, (0.1, 1.0))
    np.testing.assert_allclose(out, [[1, 1, 1], [4, 4, 4]])


def test_ema_matches_float64():
    rng = np.random.default_rng(0)
    ema = {"w": jnp.asarray(rng.standard_normal(5), jnp.float32)}
    ref = np.asarray(ema["w"], np.float64)
    for _ in range(20):
        p = rng.standard_normal(5)
        ema = diffusion.ema_update(ema, {"w": jnp.asarray(p, jnp.float32)}, 0.9)
        ref = 0.9 * ref + 0.1 * p
    np.testing.assert_allclose(ema["w"], ref, rtol=1e-5)


def test_unknown_sampler_is_an_error():
    with pytest.raises(ValueError, match="sample.sampler"):
        diffusion.sample(lambda z, t: z, jnp.zeros((1, 2)), 2, "rk4")


def test_ema_warmup_forgets_the_initial_weights():
    """With warm-up power 0 the EMA of the first n iterates is their plain mean (Polyak averaging), checked in
    float64; with power 7 the first update has decay 0 (the initial weights are gone) and the first iterate's share
    after n updates is (1/n)^8; the fixed decay caps the decays; a negative power is the fixed decay from the first
    update (0.998^200 = 67% initial weights at step 200)."""
    rng = np.random.default_rng(1)
    iterates = rng.standard_normal((30, 4))
    ema = {"w": jnp.zeros(4, jnp.float32)}  # the initial weights: forgotten by the first update
    for n, p in enumerate(iterates, start=1):
        ema = diffusion.ema_update(
            ema, {"w": jnp.asarray(p, jnp.float32)}, diffusion.ema_decay(0.9999, jnp.asarray(n), 0.0)
        )
    np.testing.assert_allclose(ema["w"], iterates.mean(0), rtol=1e-5, atol=1e-6)
    decays = np.array([float(diffusion.ema_decay(0.998, jnp.asarray(n), 7.0)) for n in range(1, 201)])
    np.testing.assert_allclose(np.prod(decays[1:20]), (1 / 20) ** 8, rtol=1e-4)
    assert decays[0] == 0.0 and np.all(np.diff(decays) >= 0) and decays.max() <= 0.998
    fixed = np.array([float(diffusion.ema_decay(0.998, jnp.asarray(n), -1.0)) for n in range(1, 201)])
    np.testing.assert_allclose(np.prod(fixed), 0.998**200, rtol=1e-5)

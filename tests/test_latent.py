"""Latent diffusion: the autoencoder trains, saves and loads exactly; a run with latent.path set trains on its
latents through the one train step, samples decode to pixels, FLOPs count the encoder, bad settings are clear
errors."""

import jax
import numpy as np
import pytest
from flax import nnx
from util import tiny_config

from reve_jax import batch as batch_lib
from reve_jax import flops, latent
from reve_jax.config import ConfigError
from reve_jax.latent import autoencoder
from reve_jax.latent import training as latent_training
from reve_jax.train import builder, sampling, trainer

AE = ("latent.channels=4", "latent.downsample=2", "latent.width=8", "latent.train_batch=16")
# Enough training for the reconstructions to carry the objects, not only the background (measured 1,500 steps at
# 4e-3: PSNR 28 dB, against 21 dB for each image's flat background colour and 9 dB untrained).
TRAINED = ("latent.train_steps=1500", "latent.train_lr=4e-3")


@pytest.fixture(scope="module")
def ae_file(tmp_path_factory):
    cfg = tiny_config(*AE, *TRAINED)
    model, info = latent_training.train(cfg)
    path = autoencoder.save(model, tmp_path_factory.mktemp("ae") / "ae.npz", info)
    return str(path), model


def test_autoencoder_round_trip_and_normalised_latents(ae_file):
    path, model = ae_file
    loaded, meta = autoencoder.load(path)
    assert meta["config"] == {"channels": 4, "downsample": 2, "width": 8, "res_blocks": 0}
    assert meta["info"]["steps"] == 1500
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(a, b)
    cfg = tiny_config(*AE)
    batches = latent_training._batches(cfg, 64, 10**6)
    x = np.concatenate([next(batches) for _ in range(16)])  # the images the statistics were measured on
    z = np.asarray(loaded.encode(x))
    assert z.shape == (1024, 8, 8, 4)
    np.testing.assert_allclose(z.reshape(-1, 4).mean(0), 0.0, atol=1e-3)
    np.testing.assert_allclose(z.reshape(-1, 4).std(0), 1.0, atol=1e-3)
    assert loaded.decode(z[:2]).shape == (2, 16, 16, 3)


def _psnr(a, b):
    return 10 * np.log10(4.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))


def test_reconstructions_of_held_out_images_carry_the_objects(ae_file):
    """docs/latent.md: the autoencoder reconstructs its data's images, the caption reader reads the reconstructions,
    and the decoder tolerates noise on the latents (it was trained on noisy ones). On held-out images the error is
    far below each image's flat background colour's (which an autoencoder that learned only the backgrounds would
    match), so the objects come through; the check stored in the file measures the same."""
    from reve_jax.data import pipeline
    from reve_jax.data.synthetic import alignment

    _, model = ae_file
    cfg = tiny_config(*AE, *TRAINED)
    ds = pipeline.eval_dataset(cfg.data, "unseen")  # compositions the autoencoder's training never showed
    idx = np.arange(64)
    real = np.stack([ds[int(i)]["image"] for i in idx]).astype(np.float32) / 127.5 - 1
    z = np.asarray(model.encode(real))
    recon = np.clip(np.asarray(model.decode(z)), -1, 1)
    flat = np.median(real.reshape(len(real), -1, 3), axis=1)[:, None, None, :]  # the background colour
    assert _psnr(recon, real) > _psnr(flat, real) + 4, (_psnr(recon, real), _psnr(flat, real))
    noisy = np.clip(np.asarray(model.decode(z + 0.1 * np.random.default_rng(0).standard_normal(z.shape))), -1, 1)
    assert _psnr(noisy, real) > _psnr(flat, real) + 2, (_psnr(noisy, real), _psnr(flat, real))
    scenes = [ds.scene(int(i)) for i in idx]
    read = alignment.score(recon, scenes)
    assert read["align_background"] == 1.0 and read["align_overall"] > 0.4, read
    check = latent_training.check_reconstructions(cfg, model, 64)
    assert check["psnr"] == pytest.approx(_psnr(recon, real), abs=0.01)
    assert check["align_real"] == 1.0 and check["align_recon"] == read["align_overall"]


@pytest.mark.parametrize("res_blocks", [0, 2])
def test_encoder_flops_match_xla_and_residual_blocks_save_exactly(res_blocks, tmp_path):
    cfg = autoencoder.AEConfig(channels=4, downsample=4, width=8, res_blocks=res_blocks)
    model = autoencoder.Autoencoder(cfg, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    x = jax.numpy.zeros((1, 32, 32, 3))
    cost = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode_raw(x)).lower(state, x).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    # The formula counts every 3x3 tap (XLA skips the zero padding at the borders: a few % fewer at 32 px).
    assert (
        0.85 * autoencoder.encoder_flops_per_image(cfg, 32, 32)
        < xla
        <= autoencoder.encoder_flops_per_image(cfg, 32, 32)
    )
    params = nnx.state(model, nnx.Param)  # off the zero init, so every residual convolution matters
    nnx.update(model, jax.tree.map(lambda v: v + 0.05 * np.sign(np.sin(np.arange(v.size))).reshape(v.shape), params))
    path = autoencoder.save(model, tmp_path / "ae.npz", {"steps": 0})
    loaded, meta = autoencoder.load(path)
    assert meta["config"]["res_blocks"] == res_blocks
    rng = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.encode(rng)), np.asarray(model.encode(rng)))


def test_missing_or_foreign_weights_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/train_autoencoder.py"):
        autoencoder.load(tmp_path / "none.npz")
    np.savez(tmp_path / "other.npz", w=np.zeros(3))
    with pytest.raises(ValueError, match="not an autoencoder file"):
        autoencoder.load(tmp_path / "other.npz")


def test_latent_run_trains_samples_pixels_and_counts_the_encoder(ae_file, tmp_path):
    path, _ = ae_file
    cfg = tiny_config(*AE, f"latent.path='{path}'", "model.patch=2", "train.steps=3", "sample.num=2")
    assert batch_lib.model_shape(cfg) == (8, 8, 4)
    run = builder.build(cfg)
    assert run.setup.abstract_state["params"]["patch_embed"]["proj_in"]["kernel"].shape[0] == 2 * 2 * 4
    pixel = tiny_config(*AE, "model.patch=4")  # the same 16 tokens on pixels
    ae_cost = autoencoder.encoder_flops_per_image(latent.ae_config(cfg), 16, 16)
    assert ae_cost > 0
    assert flops.train_flops_per_image(cfg) == pytest.approx(3 * flops.forward_flops_per_image(cfg) + ae_cost)
    assert flops.forward_flops_per_image(cfg) < flops.forward_flops_per_image(pixel)  # 16 values per token, not 48
    summary = trainer.run(cfg, tmp_path / "run")
    assert summary["step"] == 3
    fn = sampling.make_sampler(cfg, run.setup.graphdef)
    noise = sampling.fixed_noise(cfg, 2)
    assert noise.shape == (2, 8, 8, 4)
    state = run.init_state()
    text = sampling.encode_prompts(["a small red circle in the center, on a white background"] * 2, cfg.text.max_len)
    images = np.asarray(fn(state["ema"]["ema0"], text, noise, jax.random.key(0)))
    assert images.shape == (2, 16, 16, 3) and np.abs(images).max() <= 1.0
    assert list((tmp_path / "run" / "samples").glob("*.png"))


def test_latent_settings_are_checked(ae_file):
    path, _ = ae_file
    with pytest.raises(ConfigError, match="divisible by latent.downsample x model.patch"):
        tiny_config(*AE, f"latent.path='{path}'", "model.patch=16")
    with pytest.raises(ConfigError, match="do not apply"):
        tiny_config(*AE, f"latent.path='{path}'", "model.patch=2", "loss.repa_weight=0.5", "model.repa_block=0",
                    "loss.dino_path='x.npz'")  # fmt: skip
    cfg = tiny_config("latent.channels=8", "latent.downsample=2", f"latent.path='{path}'", "model.patch=2")
    with pytest.raises(ValueError, match="latent.channels=8"):
        latent.load(cfg)


def test_one_autoencoder_per_dataset_whatever_the_runs_seeds():
    """The cache key and the training ignore the run's seeds (the benchmark's seeds share one autoencoder), and
    follow what the autoencoder sees: the data's content and its own settings."""
    a = tiny_config(*AE, "seed=1", "data.seed=1")
    b = tiny_config(*AE, "seed=2", "data.seed=5")
    assert latent_training.cache_key(a) == latent_training.cache_key(b)
    assert latent_training.cache_key(a) != latent_training.cache_key(tiny_config(*AE, "data.max_objects=2"))
    assert latent_training.cache_key(a) != latent_training.cache_key(tiny_config(*AE, "latent.channels=8"))
    palette = tiny_config(*AE, "data.colors=('red','green','blue')")  # an autoencoder that never saw the others
    assert latent_training.cache_key(a) != latent_training.cache_key(palette)
    assert latent_training.cache_key(palette) != latent_training.cache_key(
        tiny_config(*AE, "data.colors=('red','green','white')")
    )
    short = ("latent.train_steps=3", "latent.train_batch=4")
    ma, _ = latent_training.train(tiny_config(*AE, *short, "seed=1", "data.seed=1"))
    mb, _ = latent_training.train(tiny_config(*AE, *short, "seed=2", "data.seed=5"))
    for x, y in zip(jax.tree.leaves(nnx.state(ma)), jax.tree.leaves(nnx.state(mb)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_interrupted_autoencoder_training_resumes_where_it_stopped(tmp_path):
    """Stopped at step 3 of 6 with its state saved, then resumed: the weights equal an uninterrupted training's
    bit for bit; a partial file of another autoencoder is a clear error; `cached` deletes the partial file once
    the weights are saved."""
    short = ("latent.train_steps=6", "latent.train_batch=4")
    cfg = tiny_config(*AE, *short)
    straight, _ = latent_training.train(cfg)
    partial = tmp_path / "ae.partial.npz"
    none, info = latent_training.train(cfg, partial=partial, stop_at=3)
    assert none is None and info["steps_done"] == 3 and partial.is_file()
    resumed, info = latent_training.train(cfg, partial=partial)
    assert info["resumes"] == 1 and info["steps"] == 6
    for x, y in zip(jax.tree.leaves(nnx.state(straight)), jax.tree.leaves(nnx.state(resumed)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = tiny_config(*AE, *short, "latent.channels=8")
    with pytest.raises(ValueError, match="partial training of another autoencoder"):
        latent_training.train(other, partial=partial)
    path = latent_training.cache_path(cfg, tmp_path / "cache")
    latent_training.partial_path(path).parent.mkdir()
    partial.replace(latent_training.partial_path(path))  # the state at step 6: `cached` resumes it a second time
    got, info = latent_training.cached(cfg, tmp_path / "cache")
    assert got == path and info["resumes"] == 2 and not latent_training.partial_path(path).exists()
    loaded, _ = autoencoder.load(path)
    for x, y in zip(jax.tree.leaves(nnx.state(straight)), jax.tree.leaves(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_fixed_rendering_run_can_use_the_jittered_renderings_autoencoder(tmp_path):
    """latent.train_render: the autoencoder trains on the rendering it names (not the run's), shares the cache entry
    of a run of that rendering, and `cached` checks it again on the run's own images, keeping the stored check."""
    short = ("latent.train_steps=3", "latent.train_batch=4")
    jitter = tiny_config(*AE, *short, "data.render='jitter'")
    fixed = tiny_config(*AE, *short, "data.render='fixed'")
    borrowed = tiny_config(*AE, *short, "data.render='fixed'", "latent.train_render='jitter'")
    assert latent_training.cache_key(borrowed) == latent_training.cache_key(jitter)
    assert latent_training.cache_key(borrowed) != latent_training.cache_key(fixed)
    mj, _ = latent_training.train(jitter)
    mb, _ = latent_training.train(borrowed)
    mf, _ = latent_training.train(fixed)
    for x, y in zip(jax.tree.leaves(nnx.state(mj)), jax.tree.leaves(nnx.state(mb)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(nnx.state(mj)), jax.tree.leaves(nnx.state(mf)), strict=True)
    )
    path, info_j = latent_training.cached(jitter, tmp_path)
    assert "check_train" not in info_j
    stamp = path.stat().st_mtime_ns
    again, info_b = latent_training.cached(borrowed, tmp_path)
    assert again == path and path.stat().st_mtime_ns == stamp  # the same file, not trained again
    assert info_b["check_train"] == info_j["check"]
    model, _ = autoencoder.load(path)
    assert info_b["check"] == latent_training.check_reconstructions(fixed, model)
    assert info_b["check"]["psnr"] != info_j["check"]["psnr"]  # measured on other images

"""The perceptual terms inside the one train step: LPIPS, DINOv2 and REPA on 8 CPU devices with small random
feature networks that the test writes in the converted format."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from util import tiny_config

from reve_jax import sharding
from reve_jax.config import ConfigError
from reve_jax.perceptual import LPIPS, DinoV2, DinoV2Config
from reve_jax.perceptual.weights import export_dinov2, export_lpips
from reve_jax.train import objective, trainer

CHANNELS = (4, 8, 8, 8, 8)
DINO = DinoV2Config(width=16, depth=1, num_heads=2, mlp_dim=32, patch_size=14, pos_grid=2)


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    lpips = export_lpips(LPIPS(CHANNELS, rngs=nnx.Rngs(0)), CHANNELS, d / "lpips.npz")
    dino = export_dinov2(DinoV2(DINO, rngs=nnx.Rngs(1)), DINO, d / "dino.npz")
    return str(lpips), str(dino)


def _cfg(weight_files, *extra):
    lpips, dino = weight_files
    return tiny_config(
        f"loss.lpips_path='{lpips}'", "loss.lpips_weight=0.1", "loss.lpips_downscale=1.0",
        f"loss.dino_path='{dino}'", "loss.dino_weight=0.01", "loss.dino_size=28",
        "loss.repa_weight=0.5", "loss.repa_dim=16", "loss.repa_hidden=32", "model.repa_block=0",
        "loss.perceptual_dtype='float32'", "train.log_every=1", *extra,
    )  # fmt: skip


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_trainer_runs_with_every_perceptual_term_on_8_devices(weight_files, tmp_path):
    cfg = _cfg(weight_files, "train.steps=2", "model.route.enabled=True", "model.route.start=0",
               "model.route.end=1")  # fmt: skip
    assert jax.device_count() == 8
    trainer.run(cfg, tmp_path)
    for m in _metrics(tmp_path):
        for term in ("loss_fm", "loss_lpips", "loss_dino", "loss_repa"):
            assert np.isfinite(m[term]) and m[term] > 0, (term, m)
        total = m["loss_fm"] + m["loss_lpips"] + m["loss_dino"] + m["loss_repa"]
        np.testing.assert_allclose(m["loss"], total, rtol=1e-5)


def _terms(cfg, frozen, x_hat, x, t, aux, heads):
    nets = {k: nnx.merge(frozen.graphdefs[k], frozen.states[k]) for k in frozen.graphdefs}
    ctx = objective.Context(cfg, x, x_hat, x, x, t, aux, heads, nets)
    return objective.terms_of(cfg, ctx, np.zeros((x.shape[0],), np.float32))


def test_perceptual_gate_on_t_switches_terms_off(weight_files):
    cfg = _cfg(weight_files, "loss.perceptual_t_min=1.0")  # t < 1 always: no sample passes the gate
    frozen = objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))
    heads = objective.build_heads(cfg)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
    x_hat = x + 0.3
    t = np.array([0.2, 0.9], np.float32)
    aux = {"repa": rng.standard_normal((2, 16, 32)).astype(np.float32), "repa_idx": np.tile(np.arange(16), (2, 1))}
    gated = _terms(cfg, frozen, x_hat, x, t, aux, heads)
    assert float(gated["loss_lpips"]) == 0.0 and float(gated["loss_dino"]) == 0.0
    assert float(gated["loss_repa"]) > 0  # REPA is not gated
    open_cfg = _cfg(weight_files, "loss.perceptual_t_min=0.5")
    half = _terms(open_cfg, frozen, x_hat, x, t, aux, heads)
    assert float(half["loss_lpips"]) > 0 and float(half["loss_dino"]) > 0


@pytest.mark.parametrize("hw", [(16, 16), (16, 24)])
def test_repa_targets_follow_the_batch_image_shape(weight_files, hw):
    """REPA's token grid comes from the batch's images (resolution stages, aspect buckets), not data.image_size:
    the term equals 1 - cos against DINOv2 tokens resampled onto (H/p, W/p), computed here from the parts."""
    cfg = _cfg(weight_files)
    frozen = objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))
    heads = objective.build_heads(cfg)
    rng = np.random.default_rng(1)
    h, w = hw
    n = (h // cfg.model.patch) * (w // cfg.model.patch)
    x = rng.uniform(-1, 1, (2, h, w, 3)).astype(np.float32)
    tokens = rng.standard_normal((2, n, cfg.model.width)).astype(np.float32)
    aux = {"repa": tokens, "repa_idx": np.tile(np.arange(n), (2, 1))}
    got = float(_terms(cfg, frozen, x, x, np.ones(2, np.float32), aux, heads)["loss_repa"])
    dino = nnx.merge(frozen.graphdefs["dino"], frozen.states["dino"])
    feats = np.asarray(dino(jax.image.resize(x, (2, 28, 28, 3), "linear", antialias=True)).patch)  # [2, 4, 16]
    grid = (h // cfg.model.patch, w // cfg.model.patch)
    target = np.asarray(jax.image.resize(feats.reshape(2, 2, 2, -1), (2, *grid, 16), "linear", antialias=True))
    proj = np.asarray(heads.repa(tokens)).reshape(2, n, 16).astype(np.float64)
    target = target.reshape(2, n, 16).astype(np.float64)
    cos = (proj * target).sum(-1) / (np.linalg.norm(proj, axis=-1) * np.linalg.norm(target, axis=-1))
    np.testing.assert_allclose(got, 0.5 * np.mean(1 - cos), rtol=1e-4)


def test_missing_weights_are_clear_errors(weight_files, tmp_path):
    with pytest.raises(ConfigError, match="loss.lpips_weight=0.1 needs loss.lpips_path"):
        tiny_config("loss.lpips_weight=0.1")
    cfg = _cfg(weight_files, f"loss.lpips_path='{tmp_path / 'nope.npz'}'")
    with pytest.raises(FileNotFoundError, match="convert_weights.py lpips"):
        objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))
    cfg = _cfg(weight_files, "loss.repa_dim=768")
    with pytest.raises(ValueError, match="loss.repa_dim=16"):
        objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))


@pytest.fixture
def random_feature_net(monkeypatch):
    """The project's feature network as REPA's target, at random weights (the wiring is under test, not the
    weights): objective.load_frozen gets it instead of the checked-in one."""
    from reve_jax.perceptual import shapes

    net = shapes.FeatureNet(shapes.DEFAULT_SPEC, nnx.Rngs(3))
    monkeypatch.setattr(shapes, "get_feature_net", lambda spec=shapes.DEFAULT_SPEC, cache_dir=None: (net, {}))
    return net


@pytest.mark.parametrize("hw, patch", [((24, 24), 8), ((16, 24), 4)])
def test_repa_to_the_feature_network_follows_the_batch_image_shape(random_feature_net, hw, patch):
    """loss.repa_target='features': 1 - cos against the feature net's per-cell embeddings (its 3 x 3 grid) of the
    clean image, resampled onto the batch's token grid; at a 3 x 3 token grid they are the embeddings themselves."""
    from reve_jax.perceptual import shapes

    cfg = tiny_config("loss.repa_weight=0.5", "loss.repa_target='features'", "loss.repa_dim=48",
                      "loss.repa_hidden=32", "model.repa_block=0", f"model.patch={patch}")  # fmt: skip
    frozen = objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))
    heads = objective.build_heads(cfg)
    rng = np.random.default_rng(2)
    h, w = hw
    grid = (h // patch, w // patch)
    n = grid[0] * grid[1]
    x = rng.uniform(-1, 1, (2, h, w, 3)).astype(np.float32)
    tokens = rng.standard_normal((2, n, cfg.model.width)).astype(np.float32)
    aux = {"repa": tokens, "repa_idx": np.tile(np.arange(n), (2, 1))}
    got = float(_terms(cfg, frozen, x, x, np.ones(2, np.float32), aux, heads)["loss_repa"])
    cells, _ = random_feature_net.embed(shapes.to_net_input(x))  # [2, 9, 48]
    cells = np.asarray(cells, np.float64).reshape(2, 3, 3, 48)
    if grid == (3, 3):
        target = cells
    else:
        target = np.asarray(jax.image.resize(cells, (2, *grid, 48), "linear", antialias=False))
    proj = np.asarray(heads.repa(tokens), np.float64).reshape(2, n, 48)
    target = target.reshape(2, n, 48)
    cos = (proj * target).sum(-1) / (np.linalg.norm(proj, axis=-1) * np.linalg.norm(target, axis=-1))
    np.testing.assert_allclose(got, 0.5 * np.mean(1 - cos), rtol=1e-4)


def test_repa_to_dinov2_without_weights_is_a_clear_error():
    with pytest.raises(ConfigError, match="repa_target='features'"):
        tiny_config("loss.repa_weight=0.5", "model.repa_block=0")


def test_dino_term_against_the_feature_network(random_feature_net):
    """loss.dino_target='features': the dino term is 1 - cos between the feature network's per-cell embeddings of
    the prediction and of the clean image (float64 reference), gated like the other perceptual terms, zero on the
    clean image itself, and it trains without any weight file."""
    from reve_jax.perceptual import shapes

    cfg = tiny_config("loss.dino_weight=0.3", "loss.dino_target='features'", "loss.perceptual_t_min=0.5")
    frozen = objective.load_frozen(cfg, sharding.make_mesh(cfg.mesh))
    assert set(frozen.graphdefs) == {objective.FEATURES}  # no DINOv2 loaded
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, (3, 32, 32, 3)).astype(np.float32)
    x_hat = np.clip(x + rng.normal(0, 0.5, x.shape), -1, 1).astype(np.float32)
    t = np.array([0.9, 0.2, 0.7], np.float32)  # the second sample is below the gate
    got = float(_terms(cfg, frozen, x_hat, x, t, {}, None)["loss_dino"])
    a, _ = random_feature_net.embed(shapes.to_net_input(x_hat))
    b, _ = random_feature_net.embed(shapes.to_net_input(x))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    per = (1 - (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).mean(-1)
    np.testing.assert_allclose(got, 0.3 * np.mean(per * (t >= 0.5)), rtol=1e-4)
    assert got > 0
    assert abs(float(_terms(cfg, frozen, x, x, t, {}, None)["loss_dino"])) < 1e-5


def test_dino_term_without_weights_is_a_clear_error():
    with pytest.raises(ConfigError, match="dino_target='features'"):
        tiny_config("loss.dino_weight=0.1")

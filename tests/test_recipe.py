"""The recipe configs: each technique is a switch on the one training path, and every recipe config trains a
few steps on 8 CPU devices (shrunk to test size, switches kept)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import tiny_config

from reve_jax import diffusion, flops
from reve_jax.config import load_config
from reve_jax.train import builder, train_state


def _shrunk(spec: str):
    full = load_config(spec)
    patch = full.model.patch
    overrides = [
        "model.width=32",
        "model.heads=2",
        "model.depth=3",
        f"data.image_size={4 * patch}",
        f"model.bottleneck={min(full.model.bottleneck, 8)}",
        "mesh.fsdp=2",
        "mesh.data=-1",
        f"diffusion.t_shift={full.diffusion.t_shift}",
    ]
    if full.model.arch == "ddt":
        overrides += ["model.ddt.enc_width=32", "model.ddt.enc_heads=2", "model.ddt.enc_depth=1"]
    return full, tiny_config(*overrides, base=spec)


def _train_steps(cfg, n=2):
    run = builder.build(cfg)
    state = run.init_state()
    batches = run.batches(0)
    out = []
    for _ in range(n):
        state, m = run.step(state, next(batches))
        out.append(jax.device_get(m))
    return run.setup, state, out


RECIPES = [
    "configs/recipe/baseline.py:tiny",
    "configs/recipe/full.py:tiny",
    "configs/recipe/full.py:tiny,jit,bottleneck,tread,muon,ddt",
    "configs/recipe/baseline.py:jit_b16",
    "configs/recipe/full.py:jit_b16",
    "configs/recipe/baseline.py:prx_1b",
    "configs/recipe/full.py:prx_1b,jit,bottleneck,tread,muon,ddt",
]


@pytest.mark.parametrize("spec", RECIPES)
def test_every_recipe_config_trains_on_8_devices(spec):
    full, cfg = _shrunk(spec)
    assert jax.device_count() == 8
    setup, state, metrics = _train_steps(cfg)
    assert int(state["step"]) == 2
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    labels = set(jax.tree.leaves(setup.param_labels))
    assert labels == ({"muon", "adamw"} if full.optim.name == "muon" else {"adamw"})
    if full.model.arch == "ddt":
        m = metrics[-1]
        assert m["loss_enc"] > 0 and m["loss_fm"] > 0
        np.testing.assert_allclose(m["loss"], m["loss_fm"] + m["loss_enc"], rtol=1e-5)


def test_baseline_and_recipe_differ_exactly_in_their_switches():
    base = load_config("configs/recipe/baseline.py:jit_b16")
    full = load_config("configs/recipe/full.py:jit_b16")
    assert (base.model.bottleneck, base.diffusion.prediction, base.optim.name, base.model.route.enabled) == (
        0,
        "v",
        "adamw",
        False,
    )
    assert (full.model.bottleneck, full.diffusion.prediction, full.optim.name, full.model.route.enabled) == (
        128,
        "x",
        "muon",
        True,
    )
    assert (base.model.width, base.model.depth, base.train.global_batch) == (
        full.model.width,
        full.model.depth,
        full.train.global_batch,
    )


def test_ddt_shapes_and_plan_tokens():
    cfg = tiny_config(
        "model.arch='ddt'",
        "model.ddt.enc_width=32",
        "model.ddt.enc_heads=2",
        "model.ddt.enc_depth=1",
        "model.ddt.enc_patch=8",
        "model.ddt.enc_downsample=4",
    )
    model = train_state.build_model(cfg)
    z = jnp.ones((2, 16, 16, 3))
    text = {"tokens": jnp.ones((2, 16), jnp.int32), "text_mask": jnp.arange(16)[None].repeat(2, 0) < 5}
    out, aux = model(z, jnp.full((2,), 0.5), text)
    assert out.shape == (2, 16, 16, 3)
    assert aux["enc_out"].shape == (2, 4, 4, 3)  # 16 px / 4, from 2x2 coarse tokens of 2x2 pixels each
    assert model.plan_proj.kernel.shape == (32, 32)
    # The plan tokens reach the decoder: with the decoder's blocks active, changing the encoder changes the output.
    from flax import nnx

    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), params)
    a, _ = nnx.merge(graphdef, params)(z, jnp.full((2,), 0.5), text)
    params["encoder"]["final"] = jax.tree.map(lambda x: x * 2.0, params["encoder"]["final"])
    params["plan_proj"] = jax.tree.map(lambda x: x * 3.0, params["plan_proj"])
    b, _ = nnx.merge(graphdef, params)(z, jnp.full((2,), 0.5), text)
    assert float(jnp.abs(a - b).max()) > 1e-5


def test_downsample_is_the_linear_pooling_of_the_flow():
    rng = np.random.default_rng(0)
    x, e = (jnp.asarray(rng.standard_normal((2, 8, 8, 3)), jnp.float32) for _ in range(2))
    t = jnp.asarray([0.3, 0.8])
    np.testing.assert_allclose(
        diffusion.downsample(diffusion.interpolate(x, e, t), 4),
        diffusion.interpolate(diffusion.downsample(x, 4), diffusion.downsample(e, 4), t),
        atol=1e-6,
    )


def test_tread_flops_count_routed_blocks_at_their_token_count():
    off = load_config("configs/jit_b16.py")
    on = load_config(
        "configs/jit_b16.py",
        ["--config.model.route.enabled=True", "--config.model.route.start=2", "--config.model.route.end=10"],
    )
    n, text, d = 256, off.text.max_len, off.model.width
    h = flops.swiglu_hidden(d, off.model.mlp_ratio, off.model.mlp_multiple_of)
    saved = 8 * (flops.block_flops(n + text, d, h) - flops.block_flops(128 + text, d, h))
    np.testing.assert_allclose(flops.forward_flops_per_image(off) - flops.forward_flops_per_image(on), saved)

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
    return full, tiny_config(*_overrides(full), base=spec)


def _overrides(full) -> list[str]:
    """A recipe config shrunk to test size, its switches kept."""
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
    return overrides


def _train_steps(cfg, n=3):
    run = builder.build(cfg)
    state = run.init_state()
    init = jax.device_get(state["params"])  # before the donated state is consumed
    batches = run.batches(0)
    out = []
    for _ in range(n):
        state, m = run.step(state, next(batches))
        out.append(jax.device_get(m))
    return run, init, state, out


def _swiglu_hidden(width, ratio, multiple):
    """The SwiGLU hidden size as docs/recipe.md states it: round(ratio * width * 2/3), up to a multiple."""
    return -(-round(ratio * width * 2 / 3) // multiple) * multiple


def _block_matmul_flops(tokens, width, hidden, keys):
    """One transformer block's forward matmuls, 2 FLOPs per multiply-add, for `tokens` updated tokens attending to
    `keys` tokens: the q and output projections and SwiGLU's three on the updated tokens, the k and v projections
    on the keys, the attention scores and their weighted sum."""
    proj = 2 * tokens * 2 * width * width + 2 * keys * 2 * width * width
    return proj + 2 * 2 * tokens * keys * width + 2 * tokens * 3 * width * hidden


def _routed_saving(cfg):
    """FLOPs per train step that TREAD saves: the routed blocks run on the kept image tokens instead of all of
    them (text and DDT plan tokens ride along in both: updated too with the joint text stream, keys and values only
    with the fixed one), forward and backward (3x the forward's matmuls)."""
    m = cfg.model
    n = (cfg.data.image_size // m.patch) ** 2
    keep = round(n * m.route.keep_ratio)
    context = cfg.text.max_len + ((cfg.data.image_size // m.ddt.enc_patch) ** 2 if m.arch == "ddt" else 0)
    end = m.route.end if m.route.end >= 0 else m.depth + m.route.end
    hidden = _swiglu_hidden(m.width, m.mlp_ratio, m.mlp_multiple_of)
    extra = context if m.text_stream == "joint" else 0
    full = _block_matmul_flops(n + extra, m.width, hidden, keys=n + context)
    per_block = full - _block_matmul_flops(keep + extra, m.width, hidden, keys=keep + context)
    return 3 * cfg.train.global_batch * (end - m.route.start) * per_block


# Each path of the recipe configs: the baseline (at two sizes), the DiT with the recipe (jit_b16; full.py:tiny is the
# same techniques at another patch size) and the JIT-DDT with it (at two sizes). Every config file and size loads in
# test_config.py.
RECIPES = [
    "configs/recipe/baseline.py:tiny",
    "configs/recipe/full.py:tiny,jit,bottleneck,tread,muon,ddt",
    "configs/recipe/full.py:jit_b16",
    "configs/recipe/baseline.py:prx_1b",
    "configs/recipe/full.py:prx_1b,jit,bottleneck,tread,muon,ddt",
]


@pytest.mark.parametrize("spec", RECIPES)
def test_every_recipe_config_trains_on_8_devices(spec):
    full, cfg = _shrunk(spec)
    assert jax.device_count() == 8
    run, init, state, metrics = _train_steps(cfg)
    assert int(state["step"]) == 3
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    labels = set(jax.tree.leaves(run.setup.param_labels))
    assert labels == ({"muon", "adamw"} if full.optim.name == "muon" else {"adamw"})
    # The bottleneck patch embedding (pixels -> rank r -> width) is in the model and trains; without it, one
    # linear map.
    params = jax.device_get(state["params"])
    embeds = [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if "patch_embed" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path)
    ]
    ranks = {x.shape[1] for path, x in embeds if "proj_in" in path}
    assert ranks == ({cfg.model.bottleneck} if full.model.bottleneck else set()), [(p, x.shape) for p, x in embeds]
    before = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(init)[0]}
    assert embeds and all(not np.array_equal(x, before[path]) for path, x in embeds), "the patch embedding is frozen"
    # TREAD routes in the step: XLA counts fewer FLOPs in the routed step than in the same step unrouted, by the
    # routed blocks' matmuls at the kept token count (the elementwise work of the routed tokens adds about 6%).
    if full.model.route.enabled:
        unrouted = tiny_config(*_overrides(full), "model.route.enabled=False", base=spec)
        saved = builder.lowered_flops(builder.build(unrouted).lower()) - run.compile().executed_flops
        assert 1.0 < saved / _routed_saving(cfg) < 1.15, (saved, _routed_saving(cfg))
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
    # Not a rescaling: the blocks normalise the plan tokens (RMSNorm), so a scaled plan reads the same to the
    # decoder's image tokens when only they are updated (model.text_stream fixed, configs/tiny.py).
    params["plan_proj"] = jax.tree.map(
        lambda x: x + 0.5 * jax.random.normal(jax.random.key(7), x.shape), params["plan_proj"]
    )
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
    assert (off.model.width, off.model.mlp_ratio, off.model.mlp_multiple_of, off.text.max_len) == (768, 4.0, 16, 32)
    # JiT-B/16 at 256 px: 256 image tokens and 32 text tokens, width 768, SwiGLU hidden 2048 (4 * 768 * 2/3).
    # Blocks 2..9 (8 of them) run on 128 image tokens instead of 256: per block the projections save
    # 2 * 128 * (4 * 768^2 + 3 * 768 * 2048), attention 4 * 768 * (288^2 - 160^2).
    per_block = 2 * 128 * (4 * 768**2 + 3 * 768 * 2048) + 4 * 768 * (288**2 - 160**2)
    saved = flops.forward_flops_per_image(off) - flops.forward_flops_per_image(on)
    assert saved == 8 * per_block
    assert flops.forward_flops_per_image(on, routed=False) == flops.forward_flops_per_image(off)  # evaluation

"""The DiT: shapes, the bottleneck embedding against its plain math, text handling, RoPE, TREAD, gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from util import tiny_config

from reve_jax.model import dit, routing
from reve_jax.model.layers import apply_rope, patchify, rope_angles, sincos_position_embedding, unpatchify
from reve_jax.train.train_state import build_model


def _inputs(cfg, b=4, seed=0):
    rng = np.random.default_rng(seed)
    s, L = cfg.data.image_size, cfg.text.max_len
    z = jnp.asarray(rng.standard_normal((b, s, s, 3)), jnp.float32)
    t = jnp.asarray(rng.uniform(0.05, 0.95, b), jnp.float32)
    lengths = rng.integers(3, L, b)
    mask = np.arange(L)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(2, 30, (b, L)), 0).astype(np.int32)
    return z, t, {"tokens": jnp.asarray(tokens), "text_mask": jnp.asarray(mask)}


def _perturbed(model, scale=0.05, seed=1):
    """Random values in every parameter (zero-initialised gates would hide most of the network)."""
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, z, t, text, drop=None, route_key=None):
    return nnx.merge(graphdef, params)(z, t, text, drop=drop, route_key=route_key)


def test_output_shape_and_zero_init():
    cfg = tiny_config()
    graphdef, params = nnx.split(build_model(cfg))
    z, t, text = _inputs(cfg)
    out, aux = _apply(graphdef, nnx.to_pure_dict(params), z, t, text)
    assert out.shape == z.shape and out.dtype == jnp.float32 and aux == {}
    # adaLN-Zero: the final projection starts at zero, so the initial output is exactly zero.
    assert float(jnp.abs(out).max()) == 0.0


def test_patchify_roundtrip_and_order():
    x = jnp.arange(2 * 8 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 8, 3)
    p = patchify(x, 4)
    assert p.shape == (2, 4, 48)
    np.testing.assert_array_equal(p[0, 1], np.asarray(x[0, 0:4, 4:8, :]).reshape(-1))  # top-right patch
    np.testing.assert_array_equal(unpatchify(p, 4, 8, 8), x)


def test_bottleneck_embedding_matches_plain_math():
    cfg = tiny_config("model.bottleneck=5")
    model = build_model(cfg)
    z, _, _ = _inputs(cfg)
    pe = model.patch_embed
    got = np.asarray(pe(z))
    x = np.asarray(z, np.float64)
    b, s, p = x.shape[0], x.shape[1], cfg.model.patch
    patches = x.reshape(b, s // p, p, s // p, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * 3)
    w1 = np.asarray(pe.proj_in.kernel[...], np.float64)
    w2 = np.asarray(pe.proj_out.kernel[...], np.float64)
    want = patches @ w1 @ w2 + np.asarray(pe.proj_out.bias[...], np.float64)
    assert w1.shape == (p * p * 3, 5) and pe.proj_in.bias is None
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_plain_embedding_without_bottleneck():
    model = build_model(tiny_config("model.bottleneck=0"))
    assert model.patch_embed.proj_in is None
    assert model.patch_embed.proj_out.kernel.shape == (48, 32)


def test_text_padding_and_dropped_captions_do_not_leak():
    cfg = tiny_config()
    graphdef, params = _perturbed(build_model(cfg))
    z, t, text = _inputs(cfg)
    out, _ = _apply(graphdef, params, z, t, text)
    noisy = dict(text, tokens=jnp.where(text["text_mask"], text["tokens"], 7))  # change only padding
    out2, _ = _apply(graphdef, params, z, t, noisy)
    np.testing.assert_allclose(out, out2, atol=1e-6)
    # A dropped caption is the null caption, whatever the text.
    drop = jnp.ones((z.shape[0],), bool)
    other = dict(text, tokens=(text["tokens"] * 3) % 30)
    a, _ = _apply(graphdef, params, z, t, text, drop=drop)
    b, _ = _apply(graphdef, params, z, t, other, drop=drop)
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert float(jnp.abs(a - out).max()) > 1e-4  # and conditioning matters


def test_without_the_pooled_caption_the_text_enters_through_attention_alone():
    """text.pooled=False: no pooled vector joins the time embedding, so with the text tokens' projection zeroed the
    caption no longer changes the output; with the pooled path (the default) it still does."""
    for pooled in (True, False):
        cfg = tiny_config(f"text.pooled={pooled}")
        graphdef, params = _perturbed(build_model(cfg))
        assert ("pool_proj" in params["text"]) == pooled and ("null_pooled" in params["text"]) == pooled
        params["text"]["proj"] = jax.tree.map(jnp.zeros_like, params["text"]["proj"])
        z, t, text = _inputs(cfg)
        other = dict(text, tokens=jnp.where(text["text_mask"], (text["tokens"] * 3) % 30, 0))
        a, _ = _apply(graphdef, params, z, t, text)
        b, _ = _apply(graphdef, params, z, t, other)
        changed = float(jnp.abs(a - b).max())
        assert changed > 1e-4 if pooled else changed == 0.0, (pooled, changed)


def test_a_fixed_text_stream_gives_every_block_the_caption_tokens_as_they_entered(monkeypatch):
    """model.text_stream=fixed: every block sees the same caption tokens (those the text conditioner made), so the
    words never mix; with joint (the default) the blocks update them, and the two models differ on the same
    weights."""
    seen = []
    block_call = dit.DiTBlock.__call__

    def recording(self, x, c, angles, lengths, **kw):
        seen.append(np.asarray(x[:, -cfg.text.max_len :]))
        return block_call(self, x, c, angles, lengths, **kw)

    monkeypatch.setattr(dit.DiTBlock, "__call__", recording)
    outs = {}
    for stream in ("joint", "fixed"):
        cfg = tiny_config("model.depth=3", f"model.text_stream='{stream}'")
        graphdef, params = _perturbed(build_model(cfg))
        z, t, text = _inputs(cfg)
        seen.clear()
        outs[stream], _ = nnx.merge(graphdef, params)(z, t, text)  # eager: the recording sees concrete values
        assert len(seen) == 3
        moved = max(float(np.abs(s - seen[0]).max()) for s in seen[1:])
        assert moved == 0.0 if stream == "fixed" else moved > 1e-3, (stream, moved)
    assert float(jnp.abs(outs["joint"] - outs["fixed"]).max()) > 1e-4
    # A block that updates only the image tokens (queries and MLP on them alone) computes what the full block
    # computes for them, with the caption rows passed through.
    block = nnx.merge(graphdef, params).blocks[1]
    rng = np.random.default_rng(3)
    b, n, s, w = 4, 16, 16 + cfg.text.max_len, cfg.model.width
    x = jnp.asarray(rng.standard_normal((b, s, w)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((b, w)), jnp.float32)
    angles = jnp.asarray(rng.uniform(-3, 3, (b, s, w // cfg.model.heads // 2)), jnp.float32)
    lengths = jnp.asarray(n + rng.integers(1, cfg.text.max_len, b), jnp.int32)
    full = block_call(block, x, c, angles, lengths)
    part = block_call(block, x, c, angles, lengths, n_update=n)
    np.testing.assert_allclose(np.asarray(part[:, :n]), np.asarray(full[:, :n]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(part[:, n:]), np.asarray(x[:, n:]))
    assert float(jnp.abs(full[:, n:] - x[:, n:]).max()) > 1e-3
    with pytest.raises(ValueError, match="text_stream"):
        build_model(tiny_config("model.text_stream='cross'"))


def test_precomputed_text_embeddings():
    cfg = tiny_config("text.encoder='precomputed'", "text.emb_dim=24")
    model = build_model(cfg)
    assert model.text.encoder is None
    z, t, text = _inputs(cfg)
    emb = jax.random.normal(jax.random.key(0), text["tokens"].shape + (24,))
    out, _ = model(z, t, {"text_emb": emb, "text_mask": text["text_mask"]})
    assert out.shape == z.shape


def test_rope_is_relative():
    d = 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)

    def score(pq, pk):
        aq = rope_angles(jnp.asarray([[pq]]), d, 100.0)
        ak = rope_angles(jnp.asarray([[pk]]), d, 100.0)
        return float(jnp.sum(apply_rope(q, aq) * apply_rope(k, ak)))

    assert score((2, 3), (5, 1)) == pytest.approx(score((4, 7), (7, 5)), rel=1e-5)
    assert score((2, 3), (5, 1)) != pytest.approx(score((2, 3), (1, 5)), rel=1e-3)
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rope(q, rope_angles(jnp.asarray([[(3, 4)]]), d, 100.0))),
        jnp.linalg.norm(q),
        rtol=1e-6,
    )


def test_sincos_position_embedding_against_float64():
    """The fixed 2D embedding equals MAE's sine-cosine formula in float64: rows in the first half of the channels,
    columns in the second, sin then cos over width/4 frequencies 10000^(-k/(width/4))."""
    width, grid = 32, np.array([(r, c) for r in range(3) for c in range(5)])
    omega = 1.0 / 10_000.0 ** (np.arange(width // 4, dtype=np.float64) / (width // 4))
    ref = np.concatenate([f(grid[:, a : a + 1] * omega) for a in (0, 1) for f in (np.sin, np.cos)], axis=1)
    np.testing.assert_allclose(sincos_position_embedding(jnp.asarray(grid), width), ref, atol=2e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_position_embedding(jnp.asarray(grid), 30)


def test_absolute_positions_break_translation_symmetry():
    """RoPE alone sees only relative offsets among image tokens; with model.pos_embed='sincos' a token's output
    depends on where it sits. On a constant input (every image token the same) only the (empty) caption's tokens,
    which sit at RoPE position (0, 0), tell tokens apart without the embedding: the interior tokens' outputs spread
    0.013 then, 0.23 with it (measured); the test asks for 5x."""
    spread = {}
    for pos_embed in ("none", "sincos"):
        cfg = tiny_config()
        cfg.model.pos_embed = pos_embed
        graphdef, params = _perturbed(build_model(cfg))
        z, t, text = _inputs(cfg, b=1)
        z = jnp.full_like(z, 0.3)
        text = {k: jnp.zeros_like(v) for k, v in text.items()}  # an empty caption
        out, _ = _apply(graphdef, params, z, t, text)
        tokens = patchify(out, cfg.model.patch)[0]
        g = cfg.data.image_size // cfg.model.patch
        interior = tokens.reshape(g, g, -1)[1:-1, 1:-1].reshape(-1, tokens.shape[-1])
        spread[pos_embed] = float(jnp.abs(interior - interior[0]).max())
    assert spread["sincos"] > 5 * spread["none"], spread


def test_routing_gather_scatter_roundtrip():
    x = jnp.arange(2 * 6 * 3, dtype=jnp.float32).reshape(2, 6, 3)
    idx = routing.sample_keep_indices(jax.random.key(0), 2, 6, 3)
    assert idx.shape == (2, 3) and bool(jnp.all(jnp.diff(idx, axis=1) > 0))
    kept = routing.gather_tokens(x, idx)
    np.testing.assert_array_equal(routing.scatter_tokens(jnp.zeros_like(x), kept, idx).sum(), kept.sum())
    np.testing.assert_array_equal(routing.scatter_tokens(x, kept, idx), x)


def _identity_span_params(cfg, graphdef, params):
    """Zero the adaLN of the routed blocks: they become exactly the identity."""
    start, end = routing.route_span(cfg.model.depth, cfg.model.route.start, cfg.model.route.end)
    for i in range(start, end):
        params["blocks"][i]["adaln"] = jax.tree.map(jnp.zeros_like, params["blocks"][i]["adaln"])
    return params


def test_tread_identity_blocks_return_tokens_bit_identical():
    cfg = tiny_config("model.depth=4", "model.route.enabled=True", "model.route.start=1", "model.route.end=3")
    graphdef, params = _perturbed(build_model(cfg))
    params = _identity_span_params(cfg, graphdef, params)
    z, t, text = _inputs(cfg)
    full, _ = _apply(graphdef, params, z, t, text)
    routed, _ = _apply(graphdef, params, z, t, text, route_key=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(routed))


def test_tread_routes_in_training_and_not_at_evaluation():
    on = tiny_config("model.depth=4", "model.route.enabled=True", "model.repa_block=1")
    graphdef, params = _perturbed(build_model(on))
    z, t, text = _inputs(on)
    full, aux_full = _apply(graphdef, params, z, t, text)
    routed, aux = _apply(graphdef, params, z, t, text, route_key=jax.random.key(0))
    assert float(jnp.abs(full - routed).max()) > 1e-5  # routing changes the computation
    n = (on.data.image_size // on.model.patch) ** 2
    keep = routing.keep_count(n, on.model.route.keep_ratio)
    assert aux["repa"].shape == (z.shape[0], keep, on.model.width)  # REPA sees the kept tokens only
    assert aux_full["repa"].shape == (z.shape[0], n, on.model.width)
    # Without a route key (evaluation, sampling) the routed config computes the plain model exactly.
    off = tiny_config("model.depth=4", "model.repa_block=1")
    plain, _ = _apply(nnx.graphdef(build_model(off)), params, z, t, text)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(plain))


def test_gradients_reach_every_parameter():
    cfg = tiny_config("model.route.enabled=True", "model.route.start=0", "model.route.end=1")
    graphdef, params = _perturbed(build_model(cfg))
    z, t, text = _inputs(cfg)
    drop = jnp.asarray([True, False, False, False])

    def loss(p):
        out, _ = _apply(graphdef, p, z, t, text, drop=drop, route_key=jax.random.key(0))
        return jnp.mean(jnp.square(out - z))

    grads = jax.grad(loss)(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    dead = [jax.tree_util.keystr(path) for path, g in flat if not float(jnp.abs(g).max()) > 0]
    assert not dead, f"no gradient reaches {dead}"


def test_bf16_compute_keeps_fp32_params():
    cfg = tiny_config("model.dtype='bfloat16'")
    model = build_model(cfg)
    assert model.blocks[0].attn.q.kernel[...].dtype == jnp.float32
    z, t, text = _inputs(cfg)
    out, _ = model(z, t, text)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize(
    "overrides",
    [
        ("model.depth=4", "model.route.enabled=True", "model.repa_block=2", "model.remat='dots'"),
        ("model.depth=3", "model.remat='block'"),
        ("model.arch='ddt'", "model.depth=3", "model.ddt.enc_depth=2", "model.ddt.enc_width=32",
         "model.ddt.enc_heads=2", "model.ddt.enc_patch=8", "model.ddt.enc_downsample=2"),
    ],
)  # fmt: skip
def test_scan_over_layers_matches_unrolled(overrides):
    """model.scan_layers (stacked blocks under lax.scan, with any remat policy) computes the same function and
    gradients as the plain unrolled model on the same weights, converted with stack_blocks."""
    plain = [o for o in overrides if not o.startswith("model.remat")]
    unrolled, scanned = tiny_config(*plain), tiny_config(*overrides, "model.scan_layers=True")
    graphdef, params = _perturbed(build_model(unrolled))
    graphdef_scan, params_scan = nnx.split(build_model(scanned))
    stacked = dit.stack_blocks(params)
    assert jax.tree.structure(stacked) == jax.tree.structure(nnx.to_pure_dict(params_scan))
    assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, nnx.to_pure_dict(params_scan))
    assert jax.tree.structure(dit.unstack_blocks(stacked)) == jax.tree.structure(params)
    z, t, text = _inputs(unrolled)
    key = jax.random.key(5)

    def loss(gd, p):
        out, aux = _apply(gd, p, z, t, text, route_key=key)
        extra = jnp.mean(jnp.square(aux["repa"])) if "repa" in aux else 0.0
        return jnp.mean(jnp.square(out - z)) + extra, out

    (l0, out0), g0 = jax.value_and_grad(functools.partial(loss, graphdef), has_aux=True)(params)
    (l1, out1), g1 = jax.value_and_grad(functools.partial(loss, graphdef_scan), has_aux=True)(stacked)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    g1 = dit.unstack_blocks(g1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    # The scanned program loops over blocks (random-key generation adds loops to both programs).
    loops_scan = jax.jit(functools.partial(loss, graphdef_scan)).lower(stacked).as_text().count("stablehlo.while")
    loops_unrolled = jax.jit(functools.partial(loss, graphdef)).lower(params).as_text().count("stablehlo.while")
    assert loops_scan > loops_unrolled


def test_scanned_blocks_carry_a_layers_axis_and_deeper_models_add_no_program():
    """Stacked parameters: one leaf per weight with a leading `layers` logical axis (replicated by the default
    rules); a deeper model's scanned program has no more matrix products."""
    cfg = tiny_config("model.scan_layers=True", "model.depth=3")
    state = nnx.state(build_model(cfg))
    spec = nnx.get_partition_spec(state)
    assert tuple(spec["blocks"]["attn"]["q"]["kernel"].get_value()) == ("layers", "embed", "heads")
    assert state["blocks"]["attn"]["q"]["kernel"][...].shape[0] == 3

    def program(depth):
        c = tiny_config("model.scan_layers=True", f"model.depth={depth}")
        gd, p = nnx.split(build_model(c))
        z, t, text = _inputs(c)
        return jax.jit(lambda p: _apply(gd, p, z, t, text)[0]).lower(nnx.to_pure_dict(p)).as_text()

    assert program(2).count("dot_general") == program(6).count("dot_general")  # one block body either way

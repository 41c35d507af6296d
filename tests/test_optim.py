"""reve_jax.optim: Newton-Schulz, Muon under FSDP, the param partition, AdamW parity, schedules, clipping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.base import get_config
from reve_jax import optim, treepath
from reve_jax.config import load_config

W, H, T, PATCH, VOCAB = 32, 64, 16, 48, 50  # model width, MLP hidden, text width, p*p*3, vocab


def make_cfg(**overrides):
    cfg = get_config().optim
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def dit_like_shapes(depth=2):
    """A params tree shaped like the DiT: blocks, patch/time/text embeddings, text encoder, final layer."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    linear = lambda i, o, bias=True: {"kernel": s(i, o), **({"bias": s(o)} if bias else {})}

    def block(w, hidden, adaln):
        b = {
            "norm1": {"scale": s(w)},
            "attn": {
                "q": linear(w, w, False),
                "k": linear(w, w, False),
                "v": linear(w, w, False),
                "out": linear(w, w),
                "q_norm": {"scale": s(8)},
                "k_norm": {"scale": s(8)},
            },
            "norm2": {"scale": s(w)},
            "mlp": {"gate": linear(w, hidden), "up": linear(w, hidden), "down": linear(hidden, w)},
        }
        if adaln:
            b["adaln"] = linear(w, 6 * w)
        return b

    return {
        "blocks": {i: block(W, H, True) for i in range(depth)},
        "patch_embed": {"down": linear(PATCH, 8, False), "up": linear(8, W)},
        "time_embed": {"fc1": linear(256, W), "fc2": linear(W, W)},
        "text_encoder": {
            "embed": {"embedding": s(VOCAB, T)},
            "blocks": {0: block(T, 2 * T, False)},
            "norm": {"scale": s(T)},
        },
        "text_proj": linear(T, W),
        "final": {"adaln": linear(W, 2 * W), "norm": {"scale": s(W)}, "linear": linear(W, PATCH)},
    }


GOLDEN_MUON = {
    f"blocks/{i}/{name}/kernel"
    for i in range(2)
    for name in ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/gate", "mlp/up", "mlp/down")
}
N_LEAVES = 2 * 17 + 3 + 4 + 17 + 2 + 5  # blocks, patch_embed, time_embed, text_encoder, text_proj, final


def flat(tree):
    return {treepath.to_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def random_like(shapes, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype), shapes)


def run(tx, params, grads_seq):
    """Apply tx for each gradient tree in turn (jitted); returns the final params."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params


# ---------------------------------------------------------------------------------------------- Newton-Schulz


def ns_reference(g, steps=5):
    """The same iteration in float64 numpy: transpose if tall, Frobenius-normalise, quintic steps."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_newton_schulz_matches_float64_reference(shape):
    g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = np.asarray(optim.newton_schulz(jnp.asarray(g), 5))
    assert out.shape == shape and out.dtype == np.float32
    np.testing.assert_allclose(out, ns_reference(g), atol=2e-5)
    # The quintic iteration oscillates in a band around 1 rather than converging (measured 0.682-1.134).
    sv = np.linalg.svd(out, compute_uv=False)
    assert sv.min() > 0.67 and sv.max() < 1.14, sv
    # The transpose rule: tall and wide inputs are each other's transposes.
    np.testing.assert_allclose(np.asarray(optim.newton_schulz(jnp.asarray(g.T), 5)), out.T, atol=1e-6)


# ------------------------------------------------------------------------------------------ Muon under a mesh


def test_muon_fsdp_sharded_equals_unsharded():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    shapes = {
        "blocks": {
            0: {
                "attn": {"q": {"kernel": jax.ShapeDtypeStruct((64, 24), jnp.float32)}},
                "mlp": {"down": {"kernel": jax.ShapeDtypeStruct((24, 64), jnp.float32)}},
            }
        }
    }
    # FSDP shards the width (embed) dimension: rows of q (tall), columns of down (wide).
    q_spec, down_spec = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P(None, "fsdp"))
    specs = {"blocks": {0: {"attn": {"q": {"kernel": q_spec}}, "mlp": {"down": {"kernel": down_spec}}}}}
    shard = lambda tree: jax.device_put(tree, specs)
    cfg = make_cfg(name="muon", clip_norm=0.0, warmup_steps=0, lr=0.02, muon_weight_decay=0.1)
    tx, _ = optim.build_optimizer(cfg, shapes, total_steps=10)
    params = random_like(shapes, 0)
    grads_seq = [random_like(shapes, 1 + i) for i in range(3)]

    expected = run(tx, params, grads_seq)
    got = run(tx, shard(params), [shard(g) for g in grads_seq])
    for path, leaf in flat(got).items():
        assert len(leaf.sharding.device_set) == 8, path
        want = np.asarray(flat(expected)[path])
        np.testing.assert_allclose(np.asarray(leaf), want, atol=1e-5, err_msg=path)
    # The check can fail: orthogonalising each of the 8 row shards on its own gives another update.
    g = np.asarray(grads_seq[0]["blocks"][0]["attn"]["q"]["kernel"])
    per_shard = np.concatenate([np.asarray(optim.newton_schulz(jnp.asarray(b))) for b in np.split(g, 8)])
    assert np.abs(per_shard - np.asarray(optim.newton_schulz(jnp.asarray(g)))).max() > 0.1


# ------------------------------------------------------------------------------------------------- Partition


def test_param_groups_golden():
    shapes = dit_like_shapes()
    labels = flat(optim.param_groups(make_cfg(name="muon"), shapes))
    assert len(labels) == N_LEAVES
    assert {p for p, g in labels.items() if g == "muon"} == GOLDEN_MUON
    assert all(g == "adamw" for p, g in labels.items() if p not in GOLDEN_MUON)
    # The text encoder's blocks look like DiT blocks but stay AdamW (patterns must match the whole path).
    assert labels["text_encoder/blocks/0/attn/q/kernel"] == "adamw"
    assert set(flat(optim.param_groups(make_cfg(name="adamw"), shapes)).values()) == {"adamw"}


def test_describe_param_groups():
    shapes = dit_like_shapes()
    text = optim.describe_param_groups(shapes, optim.param_groups(make_cfg(name="muon"), shapes))
    n_muon = sum(math.prod(flat(shapes)[p].shape) for p in GOLDEN_MUON)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert "blocks/0/mlp/down/kernel" in text and "(64, 32)" in text
    assert f"total muon: {n_muon:,} parameters in 14 tensors" in text
    assert f"total: {total:,} parameters in {N_LEAVES} tensors" in text


# --------------------------------------------------------------------------------------------- Group updates


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_adamw_group_matches_optax_adamw(name):
    shapes = dit_like_shapes(depth=1)
    cfg = make_cfg(name=name, clip_norm=0.0, lr=1e-2, muon_lr=0.05, b1=0.8, b2=0.9, eps=1e-6)
    cfg.update(dict(weight_decay=0.1, muon_weight_decay=0.3, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1))
    tx, _ = optim.build_optimizer(cfg, shapes, total_steps=6)
    params = random_like(shapes, 0)
    grads_seq = [random_like(shapes, 1 + i) for i in range(4)]
    got = flat(run(tx, params, grads_seq))

    labels = flat(optim.param_groups(cfg, shapes))
    adamw_only = lambda tree: {p: v for p, v in flat(tree).items() if labels[p] == "adamw"}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, end_value=1e-3)
    reference = optax.adamw(schedule, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.1)
    expected = run(reference, adamw_only(params), [adamw_only(g) for g in grads_seq])
    # depth 1 has one 17-leaf block less, 7 of its leaves Muon kernels
    assert len(expected) == (N_LEAVES - 17 - 7 if name == "muon" else N_LEAVES - 17)
    for path, value in expected.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


# Documented factors for kernels (16, 48) and (48, 16): moonlight 0.2*sqrt(48); keller sqrt(max(1, out/in)).
@pytest.mark.parametrize(
    ("kind", "factors"), [("moonlight", (0.2 * 48**0.5, 0.2 * 48**0.5)), ("keller", (3**0.5, 1.0))]
)
def test_muon_update_matches_reference(kind, factors):
    """Two Muon steps against numpy: Nesterov momentum, Newton-Schulz, scale, decoupled decay, muon_lr."""
    shapes = {
        "blocks": {
            0: {
                "mlp": {
                    "up": {"kernel": jax.ShapeDtypeStruct((16, 48), jnp.float32)},
                    "down": {"kernel": jax.ShapeDtypeStruct((48, 16), jnp.float32)},
                }
            }
        }
    }
    cfg = make_cfg(
        name="muon",
        muon_scale=kind,
        clip_norm=0.0,
        warmup_steps=0,
        lr=1.0,
        muon_lr=0.01,
        muon_weight_decay=0.5,
    )
    tx, _ = optim.build_optimizer(cfg, shapes, total_steps=10)
    params = random_like(shapes, 0)
    grads_seq = [random_like(shapes, 1 + i) for i in range(2)]
    got = flat(run(tx, params, grads_seq))
    for path, factor in zip(["blocks/0/mlp/up/kernel", "blocks/0/mlp/down/kernel"], factors, strict=True):
        p, m = np.asarray(flat(params)[path], np.float64), 0.0
        for grads in grads_seq:
            g = np.asarray(flat(grads)[path], np.float64)
            m = 0.95 * m + 0.05 * g
            p = p - 0.01 * (factor * ns_reference(0.95 * m + 0.05 * g) + 0.5 * p)
        np.testing.assert_allclose(np.asarray(got[path]), p, atol=1e-5, err_msg=path)


def test_muon_scale_factors():
    assert optim.muon_scale((64, 256), "moonlight") == pytest.approx(3.2)
    assert optim.muon_scale((256, 64), "moonlight") == pytest.approx(3.2)
    assert optim.muon_scale((64, 256), "keller") == pytest.approx(2.0)  # out/in for (in, out) kernels
    assert optim.muon_scale((256, 64), "keller") == pytest.approx(1.0)


def test_muon_reduces_least_squares_loss():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
    y = x @ jnp.asarray(0.1 * rng.standard_normal((32, 16)), jnp.float32)
    params = {"blocks": {0: {"mlp": {"up": {"kernel": jnp.zeros((32, 16))}}}}}
    cfg = make_cfg(name="muon", lr=0.05, schedule="cosine", warmup_steps=0, clip_norm=0.0)
    assert jax.tree.leaves(optim.param_groups(cfg, params)) == ["muon"]
    tx, _ = optim.build_optimizer(cfg, params, total_steps=60)
    loss = lambda p: jnp.mean((x @ p["blocks"][0]["mlp"]["up"]["kernel"] - y) ** 2)

    @jax.jit
    def train(params):
        def body(carry, _):
            params, state = carry
            updates, state = tx.update(jax.grad(loss)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), length=60)
        return params

    assert float(loss(train(params))) < 0.02 * float(loss(params))


# ------------------------------------------------------------------------------------- Schedules and clipping


@pytest.mark.parametrize(
    ("schedule", "mid", "end"), [("constant", 1.0, 1.0), ("cosine", 0.55, 0.1), ("linear", 0.55, 0.1)]
)
def test_schedules(schedule, mid, end):
    fn = optim.lr_schedule(make_cfg(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1), 1.0, 110)
    np.testing.assert_allclose(
        [float(fn(s)) for s in (0, 5, 10, 60, 110, 200)], [0.0, 0.5, 1.0, mid, end, end], atol=1e-6
    )
    if schedule == "cosine":  # cosine is above linear in the first half of the decay
        assert float(fn(35)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-6)


def test_clipping_applies_before_both_groups():
    shapes = dit_like_shapes(depth=1)
    params = random_like(shapes, 0)
    grads_seq = [random_like(shapes, 1, scale=10.0), random_like(shapes, 2, scale=1e-3)]
    norms = [float(optax.tree.norm(g)) for g in grads_seq]
    assert norms[0] > 1.0 > norms[1]
    clipped_seq = [jax.tree.map(lambda x, n=n: x / max(1.0, n), g) for g, n in zip(grads_seq, norms, strict=True)]

    def build(clip):
        return optim.build_optimizer(make_cfg(name="muon", clip_norm=clip, warmup_steps=0), shapes, 10)[0]

    clipped = flat(run(build(1.0), params, grads_seq))
    by_hand = flat(run(build(0.0), params, clipped_seq))
    unclipped = flat(run(build(0.0), params, grads_seq))
    for path in ("blocks/0/attn/q/kernel", "patch_embed/up/kernel"):  # one leaf of each group
        np.testing.assert_allclose(np.asarray(clipped[path]), np.asarray(by_hand[path]), atol=1e-6)
        assert np.abs(np.asarray(clipped[path]) - np.asarray(unclipped[path])).max() > 1e-5, path


# ------------------------------------------------------------------------------------------ Errors and state


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("name", "sgd", "adamw, muon"),
        ("schedule", "step", "constant, cosine, linear"),
        ("muon_scale", "unit", "moonlight, keller"),
    ],
)
def test_bad_names_raise(key, value, allowed):
    cfg = make_cfg(**{"name": "muon", key: value})
    with pytest.raises(ValueError, match=f"optim.{key}='{value}' is not one of {allowed}"):
        optim.build_optimizer(cfg, dit_like_shapes(depth=1), 10)


def test_muon_pattern_on_non_matrix_raises():
    cfg = make_cfg(name="muon", muon_patterns=(r"final/linear/bias",))
    with pytest.raises(ValueError, match="final/linear/bias of shape \\(48,\\); Muon needs 2D"):
        optim.param_groups(cfg, dit_like_shapes(depth=1))


def test_state_shapes_and_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    shapes = dit_like_shapes(depth=1)
    tx, _ = optim.build_optimizer(make_cfg(name="muon"), shapes, 10)
    abstract = jax.eval_shape(tx.init, shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    # Each state leaf whose path ends in a param path (mu, nu) has that param's shape, to take its sharding.
    param_shapes = flat(shapes)
    mirrored = 0
    for path, leaf in flat(abstract).items():
        match = max((p for p in param_shapes if path.endswith("/" + p)), key=len, default=None)
        if match:
            assert leaf.shape == param_shapes[match].shape, path
            mirrored += 1
    assert mirrored == 7 + 2 * (len(param_shapes) - 7)  # Muon: mu; AdamW: mu and nu

    params = random_like(shapes, 0)
    _, state = jax.jit(tx.update)(random_like(shapes, 1), tx.init(params), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "opt", state)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "opt", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_muon_on_stacked_blocks_equals_muon_per_block():
    """model.scan_layers stores each block weight as one [depth, in, out] leaf (path blocks/<name>/...): Muon
    labels it by the same pattern and orthogonalises every block's matrix on its own, as for blocks/<i>/..."""
    per_block = {
        "blocks": {i: {"attn": {"q": {"kernel": jax.ShapeDtypeStruct((16, 48), jnp.float32)}}} for i in range(3)}
    }
    stacked = {"blocks": {"attn": {"q": {"kernel": jax.ShapeDtypeStruct((3, 16, 48), jnp.float32)}}}}
    cfg = make_cfg(name="muon", clip_norm=0.0, warmup_steps=0, lr=0.01)
    assert optim.param_groups(cfg, stacked)["blocks"]["attn"]["q"]["kernel"] == "muon"
    params, grads = random_like(per_block, 0), [random_like(per_block, 1 + i) for i in range(2)]
    stack = lambda t: {"blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *[t["blocks"][i] for i in range(3)])}  # noqa: E731
    want = run(optim.build_optimizer(cfg, per_block, 10)[0], params, grads)
    got = run(optim.build_optimizer(cfg, stacked, 10)[0], stack(params), [stack(g) for g in grads])
    np.testing.assert_allclose(
        np.asarray(got["blocks"]["attn"]["q"]["kernel"]),
        np.asarray(stack(want)["blocks"]["attn"]["q"]["kernel"]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_wsd_schedule_is_stable_then_decays_linearly_over_the_last_share():
    cfg = load_config("configs/base.py", ["optim.schedule='wsd'", "optim.warmup_steps=10", "optim.decay_frac=0.25"])
    sched = optim.lr_schedule(cfg.optim, 1.0, 100)
    # by hand: warm-up 0 -> 1 over 10 steps, 1 until step 75, then linear to 0 at step 100
    want = {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 75: 1.0, 80: 0.8, 90: 0.4, 100: 0.0, 150: 0.0}
    assert {s: round(float(sched(s)), 6) for s in want} == want

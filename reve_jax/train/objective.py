"""The training objective: every loss term, the trainable heads that some terms own, and the frozen networks that
others read. Adding a loss term touches this module and the config only.

Terms, each logged as `loss_<name>` and summed into `loss`:

    fm     flow matching: the model's output against the target of `diffusion.loss_space` (always on)
    enc    JIT-DDT: the encoder tower's own loss on the image downsampled by model.ddt.enc_downsample
    lpips  LPIPS (VGG16) between the predicted and the clean image, gated to t >= loss.perceptual_t_min
    dino   1 - cos between DINOv2 patch tokens of the predicted and the clean image, same gate; with
           loss.dino_target='features', between the per-cell embeddings of the project's own feature network
    repa   REPA: 1 - cos between block model.repa_block's image tokens through a trainable projector (a head of
           this module) and features of the clean image resampled onto the token grid: DINOv2 patch tokens, or
           (loss.repa_target='features') the project's own feature network of the procedural dataset

The token grid of a batch comes from its image shape (H / model.patch, W / model.patch), so REPA's targets are
right under resolution stages and aspect buckets.

Trainable heads live in the params tree under the key `heads` (only when a term needs one, so runs without REPA
keep the model's own tree); the model never sees them (`model_params`). The frozen networks' weights enter the
jitted step as an argument (`frozen`), replicated over the mesh: closing over them would bake hundreds of MB
into the compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from reve_jax import batch as batch_lib
from reve_jax import diffusion, latent
from reve_jax.model.layers import dense
from reve_jax.perceptual import losses as perceptual
from reve_jax.perceptual import weights

HEADS = "heads"
AUTOENCODER = "autoencoder"
FEATURES = "features"  # the project's feature network (perceptual/shapes.py), for REPA and the dino term


# ---------------------------------------------------------------------------------------------------- Frozen nets
@dataclasses.dataclass
class FrozenNets:
    """Graph definitions (static) and parameter states (arrays, passed to the step) of the frozen networks."""

    graphdefs: dict
    states: dict


def load_frozen(cfg, mesh) -> FrozenNets:
    """Load the networks the configured terms need (none when their weights are 0), and the autoencoder of a
    latent-space run, replicated on `mesh`."""
    lo = cfg.loss
    dtype = jnp.dtype(lo.perceptual_dtype)
    modules = {}
    if latent.enabled(cfg):
        modules[AUTOENCODER] = latent.load(cfg)
    if lo.lpips_weight > 0:
        modules["lpips"] = weights.load_lpips(lo.lpips_path, dtype=dtype)
    repa_dino = lo.repa_weight > 0 and lo.repa_target == "dinov2"
    if (lo.dino_weight > 0 and lo.dino_target == "dinov2") or repa_dino:
        dino = weights.load_dinov2(lo.dino_path, dtype=dtype)
        width = dino.cfg.width
        if repa_dino and width != lo.repa_dim:
            raise ValueError(
                f"loss.repa_dim={lo.repa_dim} but the DINOv2 file {lo.dino_path} has width {width}: "
                f"set --config.loss.repa_dim={width}"
            )
        modules["dino"] = dino
    repa_features = lo.repa_weight > 0 and lo.repa_target == "features"
    if repa_features or (lo.dino_weight > 0 and lo.dino_target == "features"):
        from reve_jax.perceptual import shapes

        net, _ = shapes.get_feature_net(shapes.TRAINING_SPEC)  # not the metrics' network (DEFAULT_SPEC)
        width = shapes.TRAINING_SPEC.cell_dim
        if repa_features and width != lo.repa_dim:
            raise ValueError(f"loss.repa_dim={lo.repa_dim} but the feature network's cells are {width} wide: "
                             f"set --config.loss.repa_dim={width}")  # fmt: skip
        modules[FEATURES] = net
    replicated = NamedSharding(mesh, PartitionSpec())
    graphdefs, states = {}, {}
    for name, module in modules.items():
        graphdefs[name], state = nnx.split(module)
        host = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
        states[name] = jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, replicated, lambda idx, a=a: a[idx]), host
        )
    return FrozenNets(graphdefs, states)


def no_frozen() -> FrozenNets:
    return FrozenNets({}, {})


# ---------------------------------------------------------------------------------------------------- Heads
class RepaProjector(nnx.Module):
    """REPA's projector: an MLP from the DiT's width to the frozen feature network's width."""

    def __init__(self, width: int, hidden: int, out: int, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.fc1 = dense(width, hidden, ("embed", "mlp"), **kw)
        self.fc2 = dense(hidden, hidden, ("mlp", None), **kw)
        self.fc3 = dense(hidden, out, (None, "repa"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc3(jax.nn.silu(self.fc2(jax.nn.silu(self.fc1(x))))).astype(jnp.float32)


class Heads(nnx.Module):
    """The trainable heads of the loss terms (REPA's projector)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        m, lo = cfg.model, cfg.loss
        kw = dict(rngs=rngs, dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype))
        self.repa = RepaProjector(m.width, lo.repa_hidden, lo.repa_dim, **kw)


def has_heads(cfg) -> bool:
    return cfg.loss.repa_weight > 0


def build_heads(cfg, seed: int = 0) -> Heads | None:
    """The heads with concrete weights (inside jit or eval_shape), or None when no term needs one."""
    if not has_heads(cfg):
        return None
    with nnx.use_eager_sharding(False):
        return Heads(cfg, rngs=nnx.Rngs(seed + 7919))  # a seed stream apart from the model's


def model_params(params: dict) -> dict:
    """The model's part of a params tree (without the objective's heads)."""
    return {k: v for k, v in params.items() if k != HEADS}


# ---------------------------------------------------------------------------------------------------- Terms
@dataclasses.dataclass
class Context:
    """What a term reads. Images [B,H,W,3] in [-1, 1] float32; t [B] (t=1 clean); `aux` from the model."""

    cfg: object
    x: jax.Array
    x_hat: jax.Array
    z: jax.Array
    noise: jax.Array
    t: jax.Array
    aux: dict
    heads: Heads | None
    frozen: dict  # name -> merged frozen module

    @property
    def grid(self) -> tuple[int, int]:
        p = self.cfg.model.patch
        return self.x.shape[1] // p, self.x.shape[2] // p

    @property
    def gate(self) -> jax.Array:
        return (self.t >= self.cfg.loss.perceptual_t_min).astype(jnp.float32)


def _cosine_distance(a: jax.Array, b: jax.Array) -> jax.Array:
    """1 - cos over the last axis, in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    na = jnp.maximum(jnp.linalg.norm(a, axis=-1), 1e-8)
    nb = jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-8)
    return 1.0 - jnp.sum(a * b, -1) / (na * nb)


def repa_targets(dino, x: jax.Array, size: int, grid: tuple[int, int]) -> jax.Array:
    """DINOv2 patch tokens of the clean image, resampled onto the DiT's token grid: [B, gh*gw, D], no gradient."""
    feats = perceptual.frozen(dino)(perceptual.resize(x, size, size)).patch
    b, n, d = feats.shape
    g = int(round(n**0.5))
    feats = feats.reshape(b, g, g, d)
    if (g, g) != tuple(grid):
        feats = jax.image.resize(feats, (b, *grid, d), method="linear", antialias=True)
    return jax.lax.stop_gradient(feats.reshape(b, grid[0] * grid[1], d))


def _enc(c: Context) -> jax.Array:
    d = c.cfg.model.ddt.enc_downsample
    pool = lambda a: diffusion.downsample(a, d)  # noqa: E731
    per, _ = diffusion.loss_terms(c.aux["enc_out"], pool(c.x), pool(c.noise), pool(c.z), c.t, c.cfg.diffusion)
    return c.cfg.model.ddt.enc_loss_weight * per.mean()


def _lpips(c: Context) -> jax.Array:
    lo = c.cfg.loss
    return lo.lpips_weight * jnp.mean(
        c.gate * perceptual.lpips_loss(c.frozen["lpips"], c.x_hat, c.x, lo.lpips_downscale)
    )


def _dino(c: Context) -> jax.Array:
    lo = c.cfg.loss
    if lo.dino_target == "features":
        per = feature_loss(c.frozen[FEATURES], c.x_hat, c.x)
    else:
        per = perceptual.dino_loss(c.frozen["dino"], c.x_hat, c.x, lo.dino_size)
    return lo.dino_weight * jnp.mean(c.gate * per)


def feature_loss(net, x_hat: jax.Array, x: jax.Array) -> jax.Array:
    """The dino term against the project's feature network: 1 - cos between its per-cell embeddings of the
    prediction and of the clean image (no gradient), averaged over the 3x3 cells: [B] float32."""
    from reve_jax.perceptual import shapes

    net = perceptual.frozen(net)
    got, _ = net.embed(shapes.to_net_input(x_hat))
    ref, _ = net.embed(shapes.to_net_input(x))
    return jnp.mean(_cosine_distance(got, jax.lax.stop_gradient(ref)), axis=-1)


def feature_targets(net, x: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """The project's feature network's per-cell embeddings of the clean image (its 3x3 grid of the procedural
    scenes), resampled onto the DiT's token grid: [B, gh*gw, cell_dim], no gradient."""
    from reve_jax.perceptual import shapes

    cells, _ = perceptual.frozen(net).embed(shapes.to_net_input(x))
    b, n, d = cells.shape
    g = int(round(n**0.5))
    fmap = jax.image.resize(cells.reshape(b, g, g, d), (b, *grid, d), method="linear", antialias=False)
    return jax.lax.stop_gradient(fmap.reshape(b, grid[0] * grid[1], d))


def _repa(c: Context) -> jax.Array:
    lo = c.cfg.loss
    if lo.repa_target == "features":
        target = feature_targets(c.frozen[FEATURES], c.x, c.grid)
    else:
        target = repa_targets(c.frozen["dino"], c.x, lo.dino_size, c.grid)
    target = jnp.take_along_axis(target, c.aux["repa_idx"][..., None], axis=1)  # the kept tokens when routed
    return lo.repa_weight * jnp.mean(_cosine_distance(c.heads.repa(c.aux["repa"]), target))


@dataclasses.dataclass(frozen=True)
class Term:
    enabled: Callable[[object], bool]
    fn: Callable[[Context], jax.Array]


# Flow matching is computed with the prediction itself (it also gives x_hat); these follow it, in this order.
TERMS: dict[str, Term] = {
    "enc": Term(lambda cfg: cfg.model.arch == "ddt", _enc),
    "lpips": Term(lambda cfg: cfg.loss.lpips_weight > 0, _lpips),
    "dino": Term(lambda cfg: cfg.loss.dino_weight > 0, _dino),
    "repa": Term(lambda cfg: cfg.loss.repa_weight > 0, _repa),
}


def terms_of(cfg, c: Context, per_sample_fm: jax.Array) -> dict[str, jax.Array]:
    """Every active term's weighted scalar: {"loss_fm": ..., "loss_<name>": ...}."""
    out = {"loss_fm": per_sample_fm.mean()}
    for name, term in TERMS.items():
        if term.enabled(cfg):
            out[f"loss_{name}"] = term.fn(c)
    return out


# ---------------------------------------------------------------------------------------------------- The loss
def make_loss_fn(cfg, graphdef, heads_graphdef, frozen_graphdefs: dict):
    """loss(params, batch, key, frozen) -> (scalar loss, metrics) for one (micro) batch. `params` is the train
    state's params (the model's tree, plus `heads` when a term owns one); `frozen` the frozen networks' states."""
    dcfg = cfg.diffusion
    routed = cfg.model.route.enabled

    def loss_fn(params, batch, key, frozen):
        model = nnx.merge(graphdef, model_params(params))
        nets = {name: nnx.merge(frozen_graphdefs[name], frozen[name]) for name in frozen_graphdefs}
        x = diffusion.to_unit(batch["image"])  # uint8 from the pipeline
        if AUTOENCODER in nets:  # latent diffusion: the model denoises the frozen encoder's latents
            x = jax.lax.stop_gradient(nets[AUTOENCODER].encode(x))
        b = x.shape[0]
        k_t, k_noise, k_drop, k_route = jax.random.split(key, 4)
        t = diffusion.sample_t(k_t, b, dcfg)
        noise = dcfg.noise_scale * jax.random.normal(k_noise, x.shape, x.dtype)
        z = diffusion.interpolate(x, noise, t)
        drop = jax.random.uniform(k_drop, (b,)) < dcfg.caption_drop
        out, aux = model(z, t, batch_lib.text_inputs(batch), drop=drop, route_key=k_route if routed else None)
        per_sample, x_hat = diffusion.loss_terms(out, x, noise, z, t, dcfg)
        heads = nnx.merge(heads_graphdef, params[HEADS]) if heads_graphdef is not None else None
        ctx = Context(cfg, x, x_hat, z, noise, t, aux, heads, nets)
        terms = terms_of(cfg, ctx, per_sample)
        loss = sum(terms.values())
        return loss, dict(terms, loss=loss)

    return loss_fn

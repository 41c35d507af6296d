"""The train state and the one pure train step.

The state is a plain dict: `params` (pure dict of the DiT's parameters, plus `heads`, the objective's trainable
heads, when a loss term has one), `opt_state`, `ema` (one tree of the model's parameters per decay), `step` (int32
scalar: updates so far) and `rng` (raw key data). Everything is created sharded from abstract
shapes: nothing is materialised unsharded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from reve_jax import diffusion, optim, sharding
from reve_jax.batch import model_shape
from reve_jax.data import tokenizer
from reve_jax.model.dit import DDT, DDTArgs, DiT, ModelArgs, RouteArgs
from reve_jax.model.text import TextArgs
from reve_jax.train import objective


def model_args(cfg) -> ModelArgs:
    """The model's arguments from a run config: its `model` and `text` sections, and the channels of what it
    denoises (pixels, or the autoencoder's latents when latent.path is set: batch.model_shape)."""
    m, t = cfg.model, cfg.text
    keys = [f.name for f in dataclasses.fields(ModelArgs) if f.name not in ("in_channels", "route", "text", "ddt")]
    return ModelArgs(
        in_channels=model_shape(cfg)[2],
        **{k: m[k] for k in keys},
        route=RouteArgs(**m.route.to_dict()),
        text=TextArgs(
            encoder=t.encoder,
            vocab_size=tokenizer.VOCAB_SIZE,
            max_len=t.max_len,
            width=t.width,
            depth=t.depth,
            heads=t.heads,
            emb_dim=t.emb_dim,
            pooled=t.pooled,
        ),
        ddt=DDTArgs(**{f.name: m.ddt[f.name] for f in dataclasses.fields(DDTArgs)}),
    )


def build_model(cfg, seed: int = 0) -> DiT | DDT:
    """The NNX model (`model.arch`: dit or ddt) with concrete weights (use inside jit, or in tests)."""
    cls = DDT if cfg.model.arch == "ddt" else DiT
    with nnx.use_eager_sharding(False):
        return cls(model_args(cfg), rngs=nnx.Rngs(seed))


@dataclasses.dataclass
class Setup:
    """What the loop needs besides the state: the model's graph, the optimizer, shardings and abstract shapes."""

    cfg: object
    mesh: jax.sharding.Mesh
    graphdef: object  # the model's (sampling and evaluation merge it with `model_params`)
    heads_graphdef: object | None  # the objective's trainable heads, None when no term has one
    optimizer: optax.GradientTransformation
    lr_schedule: object
    abstract_state: dict  # ShapeDtypeStructs with shardings: the restore target
    state_shardings: dict
    param_labels: object
    logical: dict  # the params tree's logical axis names (PartitionSpecs)
    frozen: objective.FrozenNets  # frozen feature networks of the loss terms (empty when unused)


def ema_keys(cfg) -> list[str]:
    return [f"ema{i}" for i in range(len(cfg.ema.decays))]


model_params = objective.model_params


def _split_trainable(model, heads):
    """(model graphdef, heads graphdef or None, params pure dict, logical specs pure dict) of the trainables."""
    graphdef, variables = nnx.split(model)
    params = nnx.to_pure_dict(variables)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(variables))
    heads_graphdef = None
    if heads is not None:
        heads_graphdef, head_vars = nnx.split(heads)
        params[objective.HEADS] = nnx.to_pure_dict(head_vars)
        logical[objective.HEADS] = nnx.to_pure_dict(nnx.get_partition_spec(head_vars))
    return graphdef, heads_graphdef, params, logical


def make_setup(cfg, mesh, *, frozen: bool = True) -> Setup:
    """Derive graph, optimizer, shardings and abstract state from the config, without allocating weights.
    `frozen=False` skips loading the perceptual networks (for tools that only move the state around)."""
    heads = nnx.eval_shape(lambda: objective.build_heads(cfg)) if objective.has_heads(cfg) else None
    graphdef, heads_graphdef, abstract_params, logical = _split_trainable(
        nnx.eval_shape(lambda: build_model(cfg)), heads
    )
    abstract_model_params = model_params(abstract_params)
    rules = tuple(cfg.mesh.rules)
    p_shard = sharding.param_shardings(abstract_params, logical, rules, mesh)
    opt, schedule = optim.build_optimizer(cfg.optim, abstract_params, cfg.train.steps)
    abstract_opt = jax.eval_shape(opt.init, abstract_params)
    o_shard = sharding.follow_params(abstract_opt, abstract_params, p_shard, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_shardings = {
        "params": p_shard,
        "opt_state": o_shard,
        "ema": {k: model_params(p_shard) for k in ema_keys(cfg)},
        "step": replicated,
        "rng": replicated,
    }
    abstract = {
        "params": abstract_params,
        "opt_state": abstract_opt,
        "ema": {k: abstract_model_params for k in ema_keys(cfg)},
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
    }
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
    labels = optim.param_groups(cfg.optim, abstract_params)
    nets = objective.load_frozen(cfg, mesh) if frozen else objective.no_frozen()
    return Setup(cfg, mesh, graphdef, heads_graphdef, opt, schedule, abstract, state_shardings, labels, logical, nets)


def init_state(setup: Setup) -> dict:
    """Fresh state, created directly in its shardings by one jitted function."""
    cfg = setup.cfg

    def init():
        _, _, params, _ = _split_trainable(build_model(cfg, cfg.seed), objective.build_heads(cfg, cfg.seed))
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(cfg.model.param_dtype)), params)
        ema = jax.tree.map(lambda x: x.astype(jnp.float32), model_params(params))
        return {
            "params": params,
            "opt_state": setup.optimizer.init(params),
            "ema": {k: ema for k in ema_keys(cfg)},
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(cfg.seed + 1)),
        }

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def global_norm(tree) -> jax.Array:
    return optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), tree))


def make_loss_fn(setup: Setup):
    """loss(params, batch, key, frozen) -> (scalar loss, metrics): the objective (`objective.py`) for one (micro)
    batch; `frozen` holds the frozen networks' parameters."""
    return objective.make_loss_fn(setup.cfg, setup.graphdef, setup.heads_graphdef, setup.frozen.graphdefs)


def make_train_step(setup: Setup):
    """The pure step (state, batch, frozen) -> (state, metrics); `frozen` = setup.frozen.states. Gradient
    accumulation splits the global batch into `train.grad_accum` micro-batches (same global batch, less memory)."""
    cfg = setup.cfg
    accum = cfg.train.grad_accum
    loss_fn = make_loss_fn(setup)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    decays = tuple(cfg.ema.decays)

    def train_step(state, batch, frozen):
        params = state["params"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        if accum == 1:
            (_, metrics), grads = grad_fn(params, batch, key, frozen)
        else:
            micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)

            def body(carry, inp):
                i, mb = inp
                (_, m), g = grad_fn(params, mb, jax.random.fold_in(key, i), frozen)
                return jax.tree.map(jnp.add, carry, (g, m)), None

            first = jax.tree.map(lambda x: x[0], micro)
            rest = jax.tree.map(lambda x: x[1:], micro)
            (_, m0), g0 = grad_fn(params, first, jax.random.fold_in(key, 0), frozen)
            (grads, metrics), _ = jax.lax.scan(body, (g0, m0), (jnp.arange(1, accum), rest))
            grads = jax.tree.map(lambda g: g / accum, grads)
            metrics = jax.tree.map(lambda m: m / accum, metrics)
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        step = state["step"] + 1  # updates so far, this one included
        new_model = model_params(new_params)
        ema = {
            k: diffusion.ema_update(state["ema"][k], new_model, diffusion.ema_decay(d, step, cfg.ema.warmup_power))
            for k, d in zip(ema_keys(cfg), decays, strict=True)
        }
        metrics = dict(
            metrics,
            grad_norm=global_norm(grads),
            param_norm=global_norm(new_params),
            update_norm=global_norm(updates),
            lr=setup.lr_schedule(state["step"]),
        )
        new_state = dict(state, params=new_params, opt_state=opt_state, ema=ema, step=step)
        return new_state, metrics

    return train_step


def jit_train_step(setup: Setup, batch_shardings: dict):
    """The train step jitted with explicit in/out shardings and the state donated; call it as
    `step(state, batch, setup.frozen.states)`."""
    step = make_train_step(setup)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    frozen_shardings = jax.tree.map(lambda a: a.sharding, setup.frozen.states)
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, batch_shardings, frozen_shardings),
        out_shardings=(setup.state_shardings, replicated),
        donate_argnums=(0,),
    )

"""The optimizer: AdamW, or Muon for the 2D hidden weights of the transformer blocks and AdamW for the rest.

`build_optimizer(optim_cfg, params, total_steps)` returns the `optax.GradientTransformation` and the
learning-rate schedule of the AdamW group (the one the trainer logs). The chain is

    clip_by_global_norm(clip_norm)                  # over all gradients, before either group
    -> partition {"muon": Muon, "adamw": AdamW}     # or AdamW on everything when optim.name == "adamw"

Muon (Keller Jordan): Nesterov momentum, then the update is replaced by an approximate orthogonalisation of
itself (5 quintic Newton-Schulz iterations), scaled by a shape factor, plus decoupled weight decay, times the
Muon lr.

Why our own Muon rather than `optax.contrib.muon` (optax 0.2.8 read):
- `contrib.muon` shares `nesterov` and `eps` between its Muon and Adam branches, so Nesterov Muon forces a
  Nesterov Adam; our AdamW group must be plain `optax.adamw` with the config's b1/b2/eps.
- Its Nesterov step bias-corrects the buffer and the gradient with different powers, which is not the
  reference Muon update; ours is the reference `lerp` form.
- `contrib` carries no stability promise: its state (`MuonState` with a count and an `ns_coeffs` array) is
  whatever that release defines, and the CPU and GPU machines need not have the same optax. Checkpoints must
  not depend on it. Our Muon state is one momentum buffer per Muon leaf, nothing else.
The rest is stock optax (`partition`, `adamw`, `clip_by_global_norm`, `add_decayed_weights`), whose states are
NamedTuples of arrays (and empty `MaskedNode`/`EmptyState` nodes) that `jax.eval_shape` and Orbax both handle.
"""

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from reve_jax import treepath
from reve_jax.config import CHOICES

OPTIMIZERS = CHOICES["optim.name"]
SCHEDULES = CHOICES["optim.schedule"]
MUON_SCALES = CHOICES["optim.muon_scale"]
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz coefficients (Keller Jordan's Muon)
NS_EPS = 1e-7  # keeps the Frobenius normalisation finite for an all-zero update


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")


# ---------------------------------------------------------------------------------------------- Newton-Schulz


def newton_schulz(g: jax.Array, steps: int = 5) -> jax.Array:
    """Approximately orthogonalise a matrix: U S' V^T with S' near 1, where U S V^T = g.

    Takes a 2D array (any float dtype) and the number of iterations; returns an array of g's shape and dtype.
    Runs in float32. The quintic coefficients push small singular values up fast rather than converging
    exactly, so after 5 steps the singular values lie in a band around 1 (0.68-1.13 once converged; the
    scalar map peaks at 1.20), which Muon does not mind. Under jit with a sharded g, GSPMD computes the whole
    matrix's iteration (the products reduce across shards), so an FSDP-sharded weight is orthogonalised as one
    matrix, never per shard.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2D matrix, got shape {g.shape}")
    a, b, c = NS_COEFFS
    x = g.astype(jnp.float32)
    # X X^T is the smaller Gram matrix when rows <= cols; the iteration commutes with transposition.
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / (jnp.linalg.norm(x) + NS_EPS)  # Frobenius norm bounds the spectral norm: all singular values <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if transpose:
        x = x.T
    return x.astype(g.dtype)


def muon_scale(shape: tuple[int, ...], kind: str) -> float:
    """The factor multiplying the orthogonalised update of a kernel of `shape` = (in_features, out_features).

    moonlight: 0.2 * sqrt(max(in, out)), which gives the update the RMS of an AdamW update, so AdamW's lr and
    weight decay carry over (Liu et al. 2025). keller: sqrt(max(1, out/in)), Keller Jordan's factor, written
    for PyTorch's (out, in) weights as max(1, rows/cols); our kernels are (in, out), so it is
    shape[1] / shape[0] here.
    """
    _check_choice("optim.muon_scale", kind, MUON_SCALES)
    fan_in, fan_out = shape
    if kind == "moonlight":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


class MuonState(NamedTuple):
    """Muon's state: the momentum buffer, a tree mirroring the Muon leaves (same shapes and dtypes)."""

    mu: Any


def scale_by_muon(momentum: float, nesterov: bool, ns_steps: int, scale: str) -> optax.GradientTransformation:
    """Muon's direction: momentum, Newton-Schulz orthogonalisation and the shape factor; no lr, no decay.

    Takes the momentum coefficient, whether to use Nesterov momentum, the Newton-Schulz step count and the
    scale kind (see `muon_scale`); every leaf it sees must be 2D, or 3D: a stack of matrices over its leading
    axis (the stacked blocks of `model.scan_layers`), each orthogonalised on its own. Returns a
    GradientTransformation.
    """
    _check_choice("optim.muon_scale", scale, MUON_SCALES)

    def init(params):
        # jnp.zeros of shape/dtype works on arrays and on ShapeDtypeStructs alike (jax.eval_shape of init).
        return MuonState(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, state.mu, updates)
        # Nesterov: look ahead one more momentum step along the current gradient.
        direction = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, mu, updates) if nesterov else mu

        def orthogonalise(d):
            factor = jnp.asarray(muon_scale(d.shape[-2:], scale), d.dtype)
            if d.ndim == 3:  # a stack of per-block matrices (model.scan_layers): each one on its own
                return jax.vmap(lambda m: newton_schulz(m, ns_steps))(d) * factor
            if d.ndim != 2:
                raise ValueError(f"Muon takes 2D weights (or stacks of them), got a leaf of shape {d.shape}")
            return newton_schulz(d, ns_steps) * factor

        return jax.tree.map(orthogonalise, direction), MuonState(mu=mu)

    return optax.GradientTransformation(init, update)


# -------------------------------------------------------------------------------------------- Param partition


def param_groups(optim_cfg, params) -> Any:
    """Label each parameter "muon" or "adamw".

    Takes the `optim` config and a pure-dict params tree (arrays or ShapeDtypeStructs). Returns a tree of the
    same structure whose leaves are the labels. A leaf goes to Muon when optim.name == "muon" and its
    "/"-joined path (int keys stringified) fully matches one of `optim.muon_patterns` (fullmatch, so
    text_encoder/blocks/... stays AdamW).
    Raises ValueError for an unknown optim.name or a matched leaf that is neither 2D nor a 3D stack of blocks.
    """
    _check_choice("optim.name", optim_cfg.name, OPTIMIZERS)
    patterns = [re.compile(p) for p in optim_cfg.muon_patterns] if optim_cfg.name == "muon" else []

    def label(path, leaf):
        name = treepath.to_str(path)
        if not any(p.fullmatch(name) for p in patterns):
            return "adamw"
        if len(leaf.shape) not in (2, 3):
            shape = tuple(leaf.shape)
            raise ValueError(f"optim.muon_patterns matches {name} of shape {shape}; Muon needs 2D (or a 3D stack)")
        return "muon"

    return jax.tree_util.tree_map_with_path(label, params)


def describe_param_groups(params, labels) -> str:
    """A printable table of every parameter: path, shape, group, element count; then totals per group.

    Takes the params tree (arrays or ShapeDtypeStructs) and the labels from `param_groups`; returns the text.
    """
    rows = []
    for (path, leaf), group in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(labels), strict=True
    ):
        rows.append((treepath.to_str(path), str(tuple(leaf.shape)), group, math.prod(leaf.shape)))
    width = max([len(r[0]) for r in rows] + [4])
    shape_width = max([len(r[1]) for r in rows] + [5])
    lines = [f"{'path':<{width}}  {'shape':<{shape_width}}  {'group':<5}  {'count':>12}"]
    lines += [f"{p:<{width}}  {s:<{shape_width}}  {g:<5}  {n:>12,}" for p, s, g, n in rows]
    total = sum(r[3] for r in rows)
    for group in ("muon", "adamw"):
        n = sum(r[3] for r in rows if r[2] == group)
        tensors = sum(r[2] == group for r in rows)
        lines.append(f"total {group}: {n:,} parameters in {tensors} tensors ({100 * n / max(total, 1):.1f}%)")
    lines.append(f"total: {total:,} parameters in {len(rows)} tensors")
    return "\n".join(lines)


def group_summary(params, labels) -> list[str]:
    """One line per optimizer group: its parameter and tensor counts and share (for the console; the full table
    is `describe_param_groups`)."""
    counts: dict[str, list[int]] = {}
    for leaf, group in zip(jax.tree.leaves(params), jax.tree.leaves(labels), strict=True):
        c = counts.setdefault(group, [0, 0])
        c[0] += math.prod(leaf.shape)
        c[1] += 1
    total = max(sum(c[0] for c in counts.values()), 1)
    return [
        f"optimizer group {g}: {n:,} parameters in {k} tensors ({100 * n / total:.1f}%)"
        for g, (n, k) in sorted(counts.items())
    ]


# -------------------------------------------------------------------------------------------------- Schedules


def lr_schedule(optim_cfg, peak: float, total_steps: int):
    """The learning rate as a function of the step (an int or int array): returns a float32 scalar.

    Linear warm-up from 0 at step 0 to `peak` at `optim.warmup_steps`, then `optim.schedule`: constant, or a
    cosine / linear decay reaching `optim.min_lr_ratio * peak` at `total_steps` and staying there, or "wsd"
    (warm-up, stable, decay): constant at `peak`, then linear to the floor over the last `optim.decay_frac` of the
    steps.
    """
    kind = optim_cfg.schedule
    _check_choice("optim.schedule", kind, SCHEDULES)
    warmup = int(optim_cfg.warmup_steps)
    floor = float(optim_cfg.min_lr_ratio) * peak
    decay_steps = max(int(total_steps) - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = jnp.minimum(1.0, step / warmup) if warmup > 0 else 1.0
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if kind == "wsd":
            start = (1.0 - float(optim_cfg.get("decay_frac", 0.2))) * total_steps
            tail = jnp.clip((step - start) / max(total_steps - start, 1.0), 0.0, 1.0)
            value = peak + (floor - peak) * tail
        elif kind == "cosine":
            value = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        elif kind == "linear":
            value = peak + (floor - peak) * progress
        else:
            value = jnp.full_like(progress, peak)
        return ramp * value

    return schedule


# -------------------------------------------------------------------------------------------------- Optimizer


def build_optimizer(optim_cfg, params, total_steps: int):
    """The optimizer of the config.

    Takes the `optim` config, the pure-dict params tree (arrays or ShapeDtypeStructs; only paths and shapes
    are read) and the number of training steps (where decaying schedules end). Returns `(tx, schedule)`: the
    GradientTransformation (its state's structure and shapes come from `jax.eval_shape(tx.init, params)`;
    momentum leaves have their parameter's shape) and the AdamW group's lr schedule. The Muon group follows
    the same schedule with peak `optim.muon_lr` (or `optim.lr` when 0). `tx.update` needs `params` (weight
    decay).
    """
    _check_choice("optim.name", optim_cfg.name, OPTIMIZERS)
    schedule = lr_schedule(optim_cfg, optim_cfg.lr, total_steps)
    adamw = optax.adamw(
        schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay
    )
    clip = optax.clip_by_global_norm(optim_cfg.clip_norm) if optim_cfg.clip_norm > 0 else optax.identity()
    if optim_cfg.name == "adamw":
        return optax.chain(clip, adamw), schedule

    muon_peak = optim_cfg.muon_lr if optim_cfg.muon_lr > 0 else optim_cfg.lr
    muon = optax.chain(
        scale_by_muon(optim_cfg.muon_momentum, optim_cfg.muon_nesterov, optim_cfg.muon_ns_steps, optim_cfg.muon_scale),
        optax.add_decayed_weights(optim_cfg.muon_weight_decay),
        optax.scale_by_learning_rate(lr_schedule(optim_cfg, muon_peak, total_steps)),
    )
    labels = param_groups(optim_cfg, params)
    return optax.chain(clip, optax.partition({"muon": muon, "adamw": adamw}, labels)), schedule

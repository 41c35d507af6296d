"""Per-device memory of a training step on a mesh, from abstract shapes: nothing is materialised.

State (parameters, optimizer state, EMA) comes from `train_state.make_setup` on an `AbstractMesh` of any size:
its abstract state's leaves carry NamedShardings, and each leaf costs the bytes of its shard shape. Candidate
meshes for the search reuse the logical axis names of that setup (`sharding.param_shardings` and
`follow_params` again, on other abstract meshes), so one model trace serves every candidate.

Activations are estimated analytically, per device, for a micro-batch of b samples (the global batch over
data x fsdp, over grad_accum). With S tokens per sample (image tokens + text tokens), width W, SwiGLU hidden
F, H heads, tensor-parallel size t and a bytes per element of the compute dtype, one DiT block keeps for the
backward pass, per sample:

    residual stream, replicated over tensor:  4 S W a         (block input, both modulated norms, mid residual)
    tensor-sharded:                         (5 W + 3 F) S a / t  (q, k, v, normed+roped q and k, attention out;
                                                                  SwiGLU gate, up and their product)
    attention:  XLA: (4 + a) S^2 H / t   (f32 softmax and its cast);  cuDNN (flash): 4 S H / t (log-sum-exp)

Without remat every block keeps all of it; with model.remat=block a block keeps only its input (S W a) and one
block's full set is rebuilt at a time in the backward pass. The backward pass also holds one block's worth of
cotangents. TREAD-routed blocks count their kept image tokens; a JIT-DDT encoder tower is not counted. Around
the blocks: the built-in text encoder (same formula, its own sizes), and per-sample image-sized tensors (image,
noise, z, output, loss terms).

Besides the state and the activations a step holds: gradients (one copy of the parameters, two with gradient
accumulation: the running sum and the micro-batch's; the optimizer update fuses into them), the weights of the
layer in flight in the compute dtype (gathered over fsdp), and the input batch. The estimate is checked against
XLA's compiled memory analysis on CPU meshes in tests/test_plan.py; docs/planning.md gives the measured ratios.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from reve_jax import batch as batch_lib
from reve_jax import sharding
from reve_jax.model.layers import swiglu_hidden
from reve_jax.model.routing import keep_count, route_span
from reve_jax.train import builder, train_state

GIB = 2**30
STATE_GROUPS = ("params", "opt_state", "ema")


def abstract_mesh(shape: tuple[int, int, int]) -> AbstractMesh:
    """A (data, fsdp, tensor) AbstractMesh with Auto axes: shardings without devices, for any size."""
    types = (AxisType.Auto,) * len(sharding.MESH_AXES)
    try:
        return AbstractMesh(tuple(shape), sharding.MESH_AXES, axis_types=types)
    except TypeError:  # older JAX: AbstractMesh(((name, size), ...))
        return AbstractMesh(tuple(zip(sharding.MESH_AXES, shape, strict=True)))


def leaf_bytes(leaf) -> int:
    """Bytes of one device's shard of an abstract array whose `sharding` is set (all of it if unset)."""
    shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
    return math.prod(shape) * jnp.dtype(leaf.dtype).itemsize


def state_bytes(abstract_state: dict) -> dict[str, int]:
    """Per-device bytes of each part of an abstract train state: params, opt_state, ema, other (step, rng)."""
    out = {k: sum(leaf_bytes(x) for x in jax.tree.leaves(abstract_state[k])) for k in STATE_GROUPS}
    out["other"] = sum(
        leaf_bytes(x) for k, v in abstract_state.items() if k not in STATE_GROUPS for x in jax.tree.leaves(v)
    )
    return out


class StateSizer:
    """Per-device state bytes for any mesh shape, from one `make_setup` (the model is traced once)."""

    def __init__(self, setup: train_state.Setup):
        self.cfg = setup.cfg
        self.abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), setup.abstract_state)
        self.logical = setup.logical  # the params' logical axis names, mapped onto each candidate mesh
        blocks = self.abstract["params"].get("blocks", {})
        if self.cfg.model.scan_layers:  # one stacked module: every leaf has a leading [depth] axis
            self.block_params = sum(math.prod(a.shape) for a in jax.tree.leaves(blocks)) // self.cfg.model.depth
        else:
            self.block_params = max(
                (sum(math.prod(a.shape) for a in jax.tree.leaves(b)) for b in blocks.values()), default=0
            )

    def bytes_for(self, shape: tuple[int, int, int]) -> dict[str, int]:
        """`state_bytes` of the state sharded on a (data, fsdp, tensor) mesh of `shape`."""
        mesh = abstract_mesh(shape)
        params = self.abstract["params"]
        p_shard = sharding.param_shardings(params, self.logical, tuple(self.cfg.mesh.rules), mesh)
        o_shard = sharding.follow_params(self.abstract["opt_state"], params, p_shard, mesh)
        put = lambda tree, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
        ema = {k: put(v, train_state.model_params(p_shard)) for k, v in self.abstract["ema"].items()}
        state = {"params": put(params, p_shard), "opt_state": put(self.abstract["opt_state"], o_shard), "ema": ema}
        state.update({k: v for k, v in self.abstract.items() if k not in STATE_GROUPS})
        return state_bytes(state)


def _block_bytes(tokens: int, width: int, hidden: int, heads: int, t: int, a: int, flash: bool) -> dict:
    """Bytes one transformer block keeps per sample for the backward pass (module docstring's formula)."""
    attn = 4 * tokens * heads / t if flash else (4 + a) * tokens * tokens * heads / t
    return {
        "residual": 4 * tokens * width * a,
        "sharded": (5 * width + 3 * hidden) * tokens * a / t,
        "attention": attn,
        "input": tokens * width * a,
    }


def activation_bytes(cfg, micro_batch: int, tensor: int, remat: str, flash: bool) -> dict[str, float]:
    """Estimated activation bytes per device for `micro_batch` samples: blocks, text encoder, around the
    blocks, and their total. `flash`: attention through cuDNN's fused kernel (GPU), else XLA's."""
    m, t_cfg = cfg.model, cfg.text
    a = jnp.dtype(m.dtype).itemsize
    n = (cfg.data.image_size // m.patch) ** 2
    hidden = swiglu_hidden(m.width, m.mlp_ratio, m.mlp_multiple_of)
    start, end = route_span(m.depth, m.route.start, m.route.end) if m.route.enabled else (0, 0)
    kept = keep_count(n, m.route.keep_ratio)
    blocks = []
    for i in range(m.depth):
        img = kept if m.route.enabled and start <= i < end else n
        blocks.append(_block_bytes(img + t_cfg.max_len, m.width, hidden, m.heads, tensor, a, flash))
    full = [b["residual"] + b["sharded"] + b["attention"] for b in blocks]
    if remat == "block":
        kept_blocks = sum(b["input"] for b in blocks) + max(full)
    else:
        kept_blocks = sum(full)
    working = max(full)  # cotangents of the block being differentiated
    text = 0.0
    if t_cfg.encoder == "builtin":
        tb = _block_bytes(
            t_cfg.max_len, t_cfg.width, swiglu_hidden(t_cfg.width, 4.0, 16), t_cfg.heads, tensor, a, False
        )
        text = t_cfg.depth * (tb["residual"] + tb["sharded"] + tb["attention"])
    pix = cfg.data.image_size**2 * 3
    pdim = m.patch * m.patch * 3
    around = 6 * pix * 4 + n * (pdim + m.bottleneck + 3 * m.width) * a + n * pdim * 4 + t_cfg.max_len * m.width * a
    per_sample = {"blocks": kept_blocks + working, "text_encoder": text, "around_blocks": around}
    out = {k: v * micro_batch for k, v in per_sample.items()}
    out["total"] = sum(out.values())
    return out


@dataclasses.dataclass
class MemoryPlan:
    """Per-device bytes of one training step on one mesh."""

    devices: int
    mesh: dict  # axis -> size
    global_batch: int
    grad_accum: int
    remat: str
    micro_batch: int  # samples per device per micro-batch
    state: dict  # params, opt_state, ema, other
    grads: int
    weights: int  # weights of the layer in flight, in the compute dtype
    activations: dict  # activation_bytes()
    batch: int  # the input batch's shard
    budget: int  # usable bytes per device
    cost: float = 1.0  # relative step time (search heuristic, 1 = as configured)

    @property
    def arrays(self) -> int:
        """Parameters + optimizer state + EMA (+ step and rng): what the step takes as its state argument."""
        return sum(self.state.values())

    @property
    def total(self) -> int:
        return self.arrays + self.grads + self.weights + int(self.activations["total"]) + self.batch

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


def batch_bytes(cfg, per_device: int) -> int:
    """Bytes of one device's share of the input batch (batch.spec: uint8 image, tokens or embeddings, mask)."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in batch_lib.spec(cfg, None, per_device).values())


def plan_for(
    sizer: StateSizer,
    devices: int,
    shape: tuple[int, int, int],
    grad_accum: int,
    remat: str,
    budget: int,
    flash: bool = True,
) -> MemoryPlan:
    """The MemoryPlan of `sizer`'s config on a (data, fsdp, tensor) mesh `shape` with `grad_accum` and `remat`.
    Raises ValueError if the global batch does not split over data x fsdp x grad_accum."""
    cfg = sizer.cfg
    data, fsdp, tensor = shape
    dp = data * fsdp
    gb = cfg.train.global_batch
    if gb % (dp * grad_accum):
        raise ValueError(f"global batch {gb} does not split over data x fsdp = {dp} x grad_accum {grad_accum}")
    state = sizer.bytes_for(shape)
    micro = gb // dp // grad_accum
    a = jnp.dtype(cfg.model.dtype).itemsize
    params = state["params"]
    # The layer in flight: one block's weights gathered over fsdp, in the compute dtype, sharded over tensor.
    weights = math.ceil(sizer.block_params / tensor) * a
    return MemoryPlan(
        devices=devices,
        mesh=dict(zip(sharding.MESH_AXES, shape, strict=True)),
        global_batch=gb,
        grad_accum=grad_accum,
        remat=remat,
        micro_batch=micro,
        state=state,
        grads=params * (2 if grad_accum > 1 else 1),
        weights=weights,
        activations=activation_bytes(cfg, micro, tensor, remat, flash),
        batch=batch_bytes(cfg, gb // dp),
        budget=budget,
    )


def plan(cfg, devices: int, gpu_mem_gib: float = 141.0, mem_fraction: float = 0.9, flash: bool = True):
    """The memory plan of `cfg` as configured (mesh, grad_accum, remat) on `devices` devices; returns
    (MemoryPlan, StateSizer) - the sizer serves `search`. The mesh may be far larger than the devices here."""
    shape = sharding.mesh_shape(cfg.mesh, devices)
    setup = train_state.make_setup(cfg, abstract_mesh(shape))
    sizer = StateSizer(setup)
    budget = int(gpu_mem_gib * GIB * mem_fraction)
    p = plan_for(sizer, devices, shape, cfg.train.grad_accum, cfg.model.remat, budget, flash)
    p.state = state_bytes(setup.abstract_state)  # make_setup's own shardings for the configured mesh
    return p, sizer


def step_cost(shape: tuple[int, int, int], grad_accum: int, remat: str) -> float:
    """Relative step time of a candidate, to rank what fits (an ordering heuristic, not a performance model):
    remat re-runs each block's forward (training FLOPs 3x -> 4x the forward); each extra micro-batch repeats
    the weight gathers and launches (~3%); tensor parallelism adds collectives to every block (~5% per
    doubling); sharding the state over more fsdp ranks costs weight gathers that mostly overlap (~1%)."""
    _, fsdp, tensor = shape
    cost = 4 / 3 if remat == "block" else 1.0
    cost *= 1 + 0.03 * (grad_accum - 1)
    cost *= 1 + 0.05 * math.log2(tensor)
    return cost * (1 + 0.01 * math.log2(fsdp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(sizer: StateSizer, devices: int, budget: int, max_tensor: int = 8, flash: bool = True):
    """Every (fsdp, tensor, grad_accum, remat) for `devices` that splits the global batch, as MemoryPlans
    sorted by `step_cost` (then by total bytes). Tensor sizes stay within `max_tensor` (one host's GPUs)."""
    cfg = sizer.cfg
    gb = cfg.train.global_batch
    out = []
    for tensor in (t for t in _divisors(devices) if t <= max_tensor):
        for fsdp in _divisors(devices // tensor):
            shape = (devices // tensor // fsdp, fsdp, tensor)
            dp = shape[0] * fsdp
            if gb % dp:
                continue
            for accum in (k for k in _divisors(gb // dp) if k & (k - 1) == 0):
                for remat in ("none", "block"):
                    p = plan_for(sizer, devices, shape, accum, remat, budget, flash)
                    p.cost = step_cost(shape, accum, remat)
                    out.append(p)
    out.sort(key=lambda p: (p.cost, p.total))
    return out


def cheapest_fit(sizer: StateSizer, devices: int, budget: int, flash: bool = True) -> MemoryPlan | None:
    """The lowest-cost candidate of `search` that fits `budget`, or None."""
    return next((p for p in search(sizer, devices, budget, flash=flash) if p.fits), None)


def compiled_memory(cfg, mesh) -> dict[str, int]:
    """XLA's memory analysis of the trainer's compiled step of `cfg` (builder.Run.compile) on the real `mesh` (CPU
    devices in tests): argument, output, alias and temp bytes per device, and `total`. Compiles from abstract
    shapes (the batch spec of batch.py: uint8 images, as the pipeline ships them); allocates nothing."""
    mem = builder.build(cfg, mesh).compile().memory()
    # With the state donated, the outputs reuse the arguments' buffers: the peak is arguments + temp.
    return {k: mem[k] for k in ("argument", "output", "alias", "temp")} | {"total": mem["estimate"]}


def flash_for(cfg, platform: str = "gpu") -> bool:
    """Whether attention runs through cuDNN's fused kernel: model.attention=cudnn, or auto on a GPU."""
    return cfg.model.attention == "cudnn" or (cfg.model.attention == "auto" and platform == "gpu")


def overrides_for(p: MemoryPlan) -> str:
    """The --config overrides that give plan `p`'s mesh, accumulation and remat."""
    m = p.mesh
    return (
        f"--config.mesh.data={m['data']} --config.mesh.fsdp={m['fsdp']} --config.mesh.tensor={m['tensor']} "
        f"--config.train.grad_accum={p.grad_accum} --config.model.remat={p.remat}"
    )


def format_plan(cfg, p: MemoryPlan, flash: bool) -> str:
    """The per-device breakdown of plan `p` for `cfg`, and whether it fits its budget."""
    unit, div = ("GiB", GIB) if p.total >= GIB else ("MiB", GIB / 1024)
    g = lambda b: f"{b / div:>9.2f}"
    act = p.activations
    mesh = " x ".join(f"{k} {v}" for k, v in p.mesh.items())
    lines = [
        f"{cfg.name}: {p.devices} devices as {mesh}; global batch {p.global_batch}, grad_accum {p.grad_accum} "
        f"({p.micro_batch} samples per device per micro-batch), remat {p.remat}, "
        f"{cfg.model.dtype} compute, attention {'cuDNN (flash)' if flash else 'XLA'}",
        f"  {'per device':<26} {unit:>9}",
        f"  {'parameters':<26} {g(p.state['params'])}",
        f"  {'optimizer state':<26} {g(p.state['opt_state'])}",
        f"  {'EMA':<26} {g(p.state['ema'])}",
        f"  {'gradients':<26} {g(p.grads)}",
        f"  {'weights of layer in flight':<26} {g(p.weights)}",
        f"  {'activations':<26} {g(act['total'])}   (blocks {act['blocks'] / div:.2f}, text encoder "
        f"{act['text_encoder'] / div:.2f}, around the blocks {act['around_blocks'] / div:.2f})",
        f"  {'input batch':<26} {g(p.batch)}",
        f"  {'total':<26} {g(p.total)}   of {p.budget / GIB:.1f} GiB usable per device: "
        + ("fits" if p.fits else "DOES NOT FIT"),
    ]
    return "\n".join(lines)


def format_candidates(plans: list[MemoryPlan], top: int) -> str:
    """The `top` cheapest candidates that fit, one line each, with the overrides that select them."""
    fits = [p for p in plans if p.fits][:top]
    if not fits:
        return "no mesh / remat / grad_accum of these devices fits: use more devices or a smaller global batch"
    lines = [f"  {'cost':>6} {'total GiB':>9}  overrides"]
    lines += [f"  {p.cost:>6.2f} {p.total / GIB:>9.2f}  {overrides_for(p)}" for p in fits]
    return "\n".join(lines)

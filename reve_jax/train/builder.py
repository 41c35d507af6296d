"""The run builder: config (+ mesh) -> setup, state, batch iterator and the compiled train step per image shape.

Every user of the train step builds it here: `scripts/train.py` (through `trainer.run`), the speedup benchmark
(a trainer run with an evaluation hook), the throughput benchmark and the memory planner. So a benchmark times and
sizes the very program that trains.

    run = builder.build(cfg)                       # mesh, setup (abstract state, shardings, optimizer)
    state = run.init_state()                       # or restore onto run.setup.abstract_state
    compiled = run.compile()                       # AOT from abstract shapes: no data or state needed
    for batch in run.batches(position): state, metrics = run.step(state, batch)

The step is compiled once per image shape (a resolution stage or an aspect bucket) from the abstract state and
the batch spec (`batch.abstract`), so it can be compiled before the state is restored or any data is read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from functools import cached_property

import jax

from reve_jax import batch as batch_lib
from reve_jax import flops, sharding
from reve_jax.data import pipeline
from reve_jax.train import train_state

log = logging.getLogger("reve_jax")


class BatchSplitError(sharding.MeshError):
    """The global batch does not split over the data-parallel devices and micro-batches."""


def check_batch_split(cfg, mesh) -> None:
    """Raise BatchSplitError when train.global_batch does not split evenly over the mesh's data-parallel devices
    times train.grad_accum micro-batches, or over the processes."""
    tr = cfg.train
    dp = sharding.data_parallel_size(mesh)
    if tr.global_batch % (dp * tr.grad_accum) or tr.global_batch % jax.process_count():
        raise BatchSplitError(
            f"train.global_batch={tr.global_batch} must split evenly over {dp} data-parallel devices x "
            f"train.grad_accum={tr.grad_accum} micro-batches (and {jax.process_count()} processes): use a multiple "
            f"of {dp * tr.grad_accum}, or change train.grad_accum or the mesh"
        )


def lowered_flops(lowered) -> float:
    """FLOPs of a lowered step as XLA counts them over the whole (unpartitioned) program: every operation it
    executes, the model's and the optimizer's (Muon's Newton-Schulz iterations) and the frozen networks' (an
    autoencoder's encoder, REPA's target network); nan where the backend gives no count. `flops_per_step` counts
    only the model's matmuls, the convention of MFU."""
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) if cost and cost.get("flops") else float("nan")


@dataclasses.dataclass
class Compiled:
    """One AOT-compiled train step for one image shape."""

    hw: tuple[int, int]
    executable: object  # jax.stages.Compiled: executable(state, batch, frozen) -> (state, metrics)
    seconds: float  # trace, lower and compile
    lower_seconds: float  # the trace-and-lower part
    flops_per_step: float  # analytic training FLOPs of one global batch (the model's matmuls: MFU's convention)
    executed_flops: float = float("nan")  # XLA's count of the whole lowered step (`lowered_flops`)

    def memory(self) -> dict[str, int]:
        """XLA's memory analysis in bytes (argument, output, alias, temp, generated_code) and `estimate` =
        arguments + outputs - aliased (donated) + temporaries; {} where the backend gives none."""
        mem = self.executable.memory_analysis()
        if mem is None:
            return {}
        out = {
            k: int(getattr(mem, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp", "generated_code")
            if hasattr(mem, f"{k}_size_in_bytes")
        }
        out["estimate"] = out.get("argument", 0) + out.get("output", 0) - out.get("alias", 0) + out.get("temp", 0)
        return out


@dataclasses.dataclass
class Run:
    """A config made concrete on a mesh: its setup, data stages and compiled steps. See the module docstring."""

    cfg: object
    mesh: jax.sharding.Mesh
    setup: train_state.Setup
    compiled: dict = dataclasses.field(default_factory=dict)  # (H, W) -> Compiled
    on_compile: Callable[[tuple[int, int]], None] | None = None  # called before each compilation (heartbeats)

    @property
    def frozen(self) -> dict:
        """The frozen networks' states, the step's third argument."""
        return self.setup.frozen.states

    @cached_property
    def stages(self) -> tuple[pipeline.Stage, ...]:
        """The data stages (datasets opened on first use: shapes-only users never touch the data)."""
        return pipeline.make_stages(self.cfg.data, self.cfg.train.global_batch)

    def image_shapes(self) -> list[tuple[int, int]]:
        """Every (H, W) a batch of this run's data can have; each needs its own compiled step."""
        shapes = pipeline.image_shapes(self.stages)
        patches = [self.cfg.model.patch] + ([self.cfg.model.ddt.enc_patch] if self.cfg.model.arch == "ddt" else [])
        for h, w in shapes:
            for p in patches:
                if h % p or w % p:
                    raise ValueError(
                        f"the data gives {h}x{w} images, not divisible by the patch size {p}: prepare the shards "
                        "with --patch matching model.patch (and the DDT encoder patch)"
                    )
        return shapes

    def init_state(self) -> dict:
        """A fresh train state, created in its shardings."""
        return train_state.init_state(self.setup)

    @cached_property
    def jitted(self):
        """The train step jitted with the state and batch shardings (one for every image shape)."""
        shardings = jax.tree.map(lambda a: a.sharding, batch_lib.abstract(self.cfg, self.mesh))
        return train_state.jit_train_step(self.setup, shardings)

    def lower(self, hw: tuple[int, int] | None = None):
        """The train step lowered for images of shape `hw` (default data.image_size) from abstract shapes."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(
                self.setup.abstract_state, batch_lib.abstract(self.cfg, self.mesh, hw), self.frozen
            )

    def compile(self, hw: tuple[int, int] | None = None) -> Compiled:
        """The compiled step for images of shape `hw` (default data.image_size), compiled on first use."""
        hw = batch_lib.image_shape(self.cfg, hw)
        if hw not in self.compiled:
            if self.on_compile is not None:
                self.on_compile(hw)
            t0 = time.perf_counter()
            lowered = self.lower(hw)
            t_lower = time.perf_counter() - t0
            with jax.set_mesh(self.mesh):
                executable = lowered.compile()
            c = Compiled(
                hw,
                executable,
                time.perf_counter() - t0,
                t_lower,
                flops.train_flops_per_image(self.cfg, hw) * self.cfg.train.global_batch,
                lowered_flops(lowered),
            )
            self.compiled[hw] = c
            mem = c.memory()
            log.info(
                "compiled the train step for %dx%d images in %.1fs; per-device temp %.1f MiB, args %.1f MiB",
                *hw,
                c.seconds,
                mem.get("temp", 0) / 2**20,
                mem.get("argument", 0) / 2**20,
            )
        return self.compiled[hw]

    @property
    def compile_seconds(self) -> float:
        return sum(c.seconds for c in self.compiled.values())

    def step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        """One train step on a device batch (the state is donated); compiles for a new image shape first."""
        compiled = self.compile(tuple(batch["image"].shape[1:3]))
        with jax.set_mesh(self.mesh):
            return compiled.executable(state, batch, self.frozen)

    def host_batches(self, position: int) -> Iterator[dict]:
        """This process's rows of every global batch from data position `position` on (numpy, with `index`)."""
        tr = self.cfg.train
        return pipeline.make_batch_iterator(
            self.cfg.data,
            self.cfg.text.max_len,
            tr.global_batch,
            jax.process_index(),
            jax.process_count(),
            position,
            text_cfg=self.cfg.text,
            stages=self.stages,
        )

    def to_device(self, local: dict) -> dict:
        return batch_lib.to_device(local, self.mesh, self.cfg.train.global_batch)

    def batches(self, position: int) -> Iterator[dict]:
        """Device batches from data position `position` on."""
        return map(self.to_device, self.host_batches(position))


def build(cfg, mesh=None, *, frozen: bool = True) -> Run:
    """The Run of `cfg` on `mesh` (default: the config's mesh over every device). Checks that the global batch
    splits over the mesh (BatchSplitError) before anything is traced. `frozen=False` skips loading the perceptual
    networks (tools that only move or size the state)."""
    mesh = sharding.make_mesh(cfg.mesh) if mesh is None else mesh
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        check_batch_split(cfg, mesh)
    return Run(cfg, mesh, train_state.make_setup(cfg, mesh, frozen=frozen))

"""The one training loop, with hooks.

    result = loop.run_loop(run, state, batches, start_step, end_step, hooks, clock=Clock(...))

Each iteration dispatches one step, fetches the next batch while the step runs, then calls the hooks that are
due. A hook is an object with

    due(ctx) -> bool        whether it runs after this step (ctx.step counts completed steps)
    __call__(ctx)           its work: log, evaluate, sample, checkpoint, decide to stop
    timed: bool             False: the train clock stops while it runs (the loop waits for the step first)
    after_dispatch(ctx)     optional: called right after the next step is dispatched (a staged checkpoint commits)
    close(ctx)              optional: called once when the loop ends, also on an error

Hooks run in list order; a hook ends the run by setting `ctx.stop` to a reason ("stopped"), after which the
remaining hooks still run for this step (so a checkpoint hook placed after it saves). The train clock counts
wall-clock and process CPU seconds spent training: compilation and untimed hooks (evaluation, sampling,
checkpoint writes) are excluded, which is what the speedup benchmark reports.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax


@dataclasses.dataclass
class Clock:
    """Training wall-clock and process CPU seconds, cumulative over a run (carried in checkpoints)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    _wall0: float | None = None
    _cpu0: float = 0.0

    def start(self):
        if self._wall0 is None:
            self._wall0, self._cpu0 = time.perf_counter(), time.process_time()

    def stop(self):
        if self._wall0 is not None:
            self.wall_s += time.perf_counter() - self._wall0
            self.cpu_s += time.process_time() - self._cpu0
            self._wall0 = None

    @property
    def running(self) -> bool:
        return self._wall0 is not None

    def read(self) -> tuple[float, float]:
        """(wall_s, cpu_s) so far, including the running interval."""
        if self._wall0 is None:
            return self.wall_s, self.cpu_s
        return self.wall_s + time.perf_counter() - self._wall0, self.cpu_s + time.process_time() - self._cpu0


@dataclasses.dataclass
class Context:
    """What hooks see and change. `state` is the live train state (do not keep references across steps: the
    next step donates it); `metrics` the step's metrics, still on the device."""

    run: object  # builder.Run
    state: dict
    step: int
    start_step: int
    end_step: int
    clock: Clock
    metrics: dict | None = None
    flops: float = 0.0  # executed training FLOPs so far (cumulative over the run)
    data_wait_s: float = 0.0  # seconds blocked on the input pipeline since the last log
    stop: str | None = None  # set by a hook: end the run after this step's hooks
    values: dict | None = None  # host copies of `metrics` once a hook fetched them (see `host_metrics`)
    extra: dict = dataclasses.field(default_factory=dict)  # metrics a hook adds for the log hook to write
    start_wall: float = 0.0  # the clock's wall seconds and the FLOPs when this loop started (a resumed run's)
    start_flops: float = 0.0

    @property
    def last(self) -> bool:
        return self.step >= self.end_step

    @property
    def samples(self) -> int:
        return self.step * self.run.cfg.train.global_batch

    def host_metrics(self) -> dict:
        """The step's metrics as Python floats (fetched once per step)."""
        if self.values is None:
            self.values = {k: float(v) for k, v in jax.device_get(self.metrics).items()}
        return self.values


@dataclasses.dataclass
class Result:
    reason: str  # "finished" | a hook's stop reason
    step: int
    state: dict


def _call(hooks, name: str, ctx: Context):
    for h in hooks:
        fn = getattr(h, name, None)
        if fn is not None:
            fn(ctx)


def run_loop(
    run,
    state: dict,
    batches: Iterator[dict],
    start_step: int,
    end_step: int,
    hooks: Sequence = (),
    *,
    clock: Clock | None = None,
    flops: float = 0.0,
    beat=None,
) -> Result:
    """Train from `start_step` (completed steps) to `end_step` on device batches from `batches`, calling `hooks`
    (module docstring). `clock` and `flops` carry a resumed run's totals; `beat(step, phase)` reports progress
    to a supervisor. Returns the reason, the last completed step and the final state."""
    clock = clock or Clock()
    ctx = Context(run, state, start_step, start_step, end_step, clock, flops=flops)
    ctx.start_wall, ctx.start_flops = clock.wall_s, flops
    beat = beat or (lambda step, phase="train": None)
    try:
        if ctx.step >= end_step:
            return Result("finished", ctx.step, ctx.state)
        batch = next(batches)
        while ctx.step < end_step:
            hw = tuple(batch["image"].shape[1:3])
            if hw not in run.compiled:  # a new resolution stage or bucket: compile off the clock
                jax.block_until_ready(ctx.state)
                clock.stop()
                beat(ctx.step, "compiling")
            compiled = run.compile(hw)
            clock.start()
            with jax.set_mesh(run.mesh):
                ctx.state, ctx.metrics = compiled.executable(ctx.state, batch, run.frozen)
            ctx.values = None
            _call(hooks, "after_dispatch", ctx)
            ctx.step += 1
            ctx.flops += compiled.flops_per_step
            if ctx.step < end_step:
                t0 = time.perf_counter()
                batch = next(batches)
                ctx.data_wait_s += time.perf_counter() - t0
            beat(ctx.step)
            for h in hooks:  # in order: an earlier hook's ctx.stop makes a later one due
                if not h.due(ctx):
                    continue
                if not h.timed and clock.running:
                    jax.block_until_ready(ctx.state)
                    clock.stop()
                h(ctx)
            if ctx.stop is not None:
                break
        jax.block_until_ready(ctx.state)
        clock.stop()
        return Result(ctx.stop or "finished", ctx.step, ctx.state)
    finally:
        clock.stop()
        _call(hooks, "close", ctx)

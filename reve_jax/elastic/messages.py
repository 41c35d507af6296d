"""What the elastic policy takes in and gives out: observations stamped with the caller's clock (events) and
the actions it asks for. Plain frozen dataclasses, so the supervisor and the cluster simulator build and read them
alike (`reve_jax.elastic.policy` re-exports them).
"""

from __future__ import annotations

import dataclasses


# ------------------------------------------------------------------------------------------------ events in
@dataclasses.dataclass(frozen=True)
class Beat:
    """A heartbeat of the worker on `host` in group `attempt`: its state's `step` and what it is doing."""

    t: float
    attempt: int
    host: str
    step: int
    phase: str = "train"
    start_step: int | None = None  # the step the worker's state started from (the restored step), once known
    where: str = ""  # the main thread's file:line:function, to tell a hung host from ones waiting on it
    joined: bool = False  # the process has joined the JAX process group
    compile_s: float = 0.0  # seconds spent tracing, lowering and compiling (or loading compiled) programs so far
    restarts: int = 0  # in-process recoveries so far: a start step reported before the latest one is stale


@dataclasses.dataclass(frozen=True)
class Exit:
    t: float
    attempt: int
    host: str
    code: int  # negative: killed by that signal


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    t: float
    host: str
    ok: bool


@dataclasses.dataclass(frozen=True)
class Tick:
    t: float


@dataclasses.dataclass(frozen=True)
class Preempt:
    """The supervisor was asked to stop (SIGTERM): save and exit; a second one kills at once."""

    t: float


Event = Beat | Exit | ProbeResult | Tick | Preempt


# ---------------------------------------------------------------------------------------------- actions out
@dataclasses.dataclass(frozen=True)
class Launch:
    attempt: int
    hosts: tuple[str, ...]  # process i runs on hosts[i]; hosts[0] holds the coordinator


@dataclasses.dataclass(frozen=True)
class Kill:
    attempt: int
    reason: str


@dataclasses.dataclass(frozen=True)
class RequestStop:
    """Ask group `attempt` to save a checkpoint and exit 0."""

    attempt: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Probe:
    host: str


@dataclasses.dataclass(frozen=True)
class Record:
    """One line for the events file."""

    kind: str
    data: dict


@dataclasses.dataclass(frozen=True)
class Finish:
    status: str  # finished | preempted | failed
    reason: str


Action = Launch | Kill | RequestStop | Probe | Record | Finish

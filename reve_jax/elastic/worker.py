"""The worker's side of the elastic supervisor: join the process group, beat, and notice a request to stop.

The trainer calls `init_from_env()` first thing, before it touches JAX devices:

    ctx = init_from_env()                  # jax.distributed joined when launched by the supervisor
    ctx.beat(-1, "restoring"); ...restore...
    ctx.beat(step, "compiling")            # the restored step: the supervisor counts lost work from it
    for ...:
        state = train_step(...); step += 1
        ctx.beat(step, "train")            # cheap: stores two values, a thread sends them
        if any_process(ctx.stop_requested()): save(step); break   # every process agrees, then stops
    ctx.close()                            # exit 0: finished or stopped on request; non-zero: failed

Without the supervisor's variables (REVE_NUM_PROCESSES unset) every call is a no-op for one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import ipaddress
import os
import signal
import sys
import threading

from reve_jax.elastic import auth, inprocess, standby
from reve_jax.elastic.channel import HeartbeatClient
from reve_jax.elastic.fence import Fence


@dataclasses.dataclass
class WorkerContext:
    """This process's place in the group and its link to the supervisor."""

    process_id: int = 0
    num_processes: int = 1
    host: str = ""
    attempt: int = 0
    supervised: bool = False  # launched by the supervisor
    coordinator: str = ""  # host:port of JAX's coordination service (its host is on this host's route to the group)
    secret: bytes | None = dataclasses.field(default=None, repr=False)  # the run's key: snapshot traffic is signed
    in_process: bool = False  # survivors of a failure go on in this process (inprocess.py)
    _client: HeartbeatClient | None = None
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _fence: Fence | None = None

    def beat(self, step: int, phase: str = "train") -> None:
        """Reports the state's step (steps completed) and what the process is doing: "restoring",
        "compiling", "train", "saving"... Phases other than "train" get the longer start-up grace before
        counting as hung."""
        if self._client is not None:
            self._client.update(step, phase)

    def stop_requested(self) -> bool:
        """True once the supervisor asked the group to stop at the next checkpoint, or on a local
        SIGTERM/SIGINT. Processes may see it at different steps: agree with `any_process` before
        stopping."""
        client_stop = self._client is not None and self._client.stop_event.is_set()
        return client_stop or self._stop.is_set()

    def recovering(self) -> None:
        """This process recovers in-process (inprocess.py): the next "compiling" beat reports the step it
        restarted from, as after a relaunch (the supervisor times the recovery and counts lost steps from it)."""
        if self._client is not None:
            self._client.restart()
        self.beat(-1, "restoring")

    def fenced(self) -> bool:
        """True once the supervisor gave up on this group and a later one owns the run directory (fence.py): the
        process must not write there (the guard installed by init_from_env exits it at its next write)."""
        return self._fence is not None and self._fence.fenced()

    def guard_writes(self, path: str) -> None:
        """Fences writes under `path` as under the run directory (a directory the run writes elsewhere: the
        host's snapshot store). No-op without a fence (not launched by the supervisor)."""
        if self._fence is not None:
            self._fence.guard(path)

    def close(self) -> None:
        """Sends the last state (phase "exiting": the process may wait in JAX's shutdown without beating) and
        stops the heartbeat thread; a recoverable group's processes leave together (inprocess.leave)."""
        if self.in_process:
            inprocess.leave(self.process_id, self.num_processes)
        if self._client is not None:
            self._client.exiting()
            self._client.close()
            self._client = None


def init_from_env(environ: dict | None = None) -> WorkerContext:
    """Joins the process group the supervisor launched this process into, from its environment variables.

    Takes `environ` (default os.environ): REVE_COORDINATOR (host:port), REVE_NUM_PROCESSES, REVE_PROCESS_ID,
    REVE_HEARTBEAT (host:port of the supervisor's channel), REVE_HOST, REVE_ATTEMPT, and optionally
    REVE_HEARTBEAT_INTERVAL, REVE_INIT_TIMEOUT, REVE_JAX_HEARTBEAT_TIMEOUT, REVE_SHUTDOWN_TIMEOUT (s),
    REVE_ORPHAN_TIMEOUT (s), REVE_SECRET (the channel's key; removed from `environ` once read), REVE_WORKDIR
    (the run directory: writes there are fenced once a later group owns it). Returns the WorkerContext; a
    single-process no-op one without REVE_NUM_PROCESSES.
    """
    env = os.environ if environ is None else environ
    if not env.get("REVE_NUM_PROCESSES"):
        return WorkerContext()
    secret = auth.secret_from_env(env)  # removed from the environment: processes we start do not inherit it
    if env.get("REVE_STANDBY"):
        # A warm standby (standby.py): imports now, and learns its place in a group from the supervisor.
        standby.wait_for_assignment(env, secret)
    ctx = WorkerContext(
        process_id=int(env["REVE_PROCESS_ID"]),
        num_processes=int(env["REVE_NUM_PROCESSES"]),
        host=env.get("REVE_HOST", ""),
        attempt=int(env.get("REVE_ATTEMPT", "0")),
        supervised=True,
        coordinator=env.get("REVE_COORDINATOR", ""),
        secret=secret,
        in_process=inprocess.enabled(env),
    )
    if env.get("REVE_WORKDIR"):
        # Before anything can write: a process of a group the supervisor gave up on must not touch the run.
        ctx._fence = Fence(env["REVE_WORKDIR"], ctx.attempt).install()
    if env.get("REVE_HEARTBEAT"):
        if secret is None:
            raise RuntimeError(f"REVE_HEARTBEAT is set but {auth.SECRET_ENV} is not: the channel needs the secret")
        # Beat before joining: jax.distributed.initialize blocks until every process is in, and the supervisor
        # should see this process alive (phase "starting") meanwhile.
        identity = {
            "host": ctx.host,
            "attempt": ctx.attempt,
            "process_id": ctx.process_id,
            "pid": os.getpid(),
        }
        ctx._client = HeartbeatClient(
            env["REVE_HEARTBEAT"],
            identity,
            secret,
            interval=float(env.get("REVE_HEARTBEAT_INTERVAL", "0.5")),
            orphan_timeout=float(env.get("REVE_ORPHAN_TIMEOUT", "0")),
            on_fenced=(lambda: ctx._fence.exit_fenced("heartbeat reply")) if ctx._fence is not None else None,
        ).start()
    if ctx.num_processes > 1:
        if ctx._client is not None:
            ctx._client.update(-1, "joining")
        _join_jax(env, ctx)
    if ctx._client is not None:
        ctx._client.note(wake=True, joined=True)
        _report_compile_time(ctx._client)
    _install_signal_handlers(ctx._stop)
    return ctx


# JAX's timings of tracing, lowering and compiling (or loading from the cache) a program.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def _report_compile_time(client: HeartbeatClient) -> None:
    """Beats carry the seconds this process has spent compiling so far, so the supervisor can tell compilation
    from the first step in a recovery's time split."""
    import jax

    total = [0.0]

    def listener(event: str, duration: float, **_):
        if event in _COMPILE_EVENTS:
            total[0] += duration
            client.note(compile_s=round(total[0], 3))

    with contextlib.suppress(AttributeError):  # an older or newer JAX without this API: no split
        jax.monitoring.register_event_duration_secs_listener(listener)


def _join_jax(env, ctx: WorkerContext) -> None:
    import jax

    from reve_jax import xla

    # One compile per group instead of one per process, and executables compiled ahead for this group size.
    if env.get("REVE_SHARE_EXECUTABLES", "1") != "0":
        xla.share_executables_between_processes()
    if ctx.in_process:
        inprocess.configure(env)
    # CPU processes talk through gloo; the option is harmless on GPU and may be gone in later versions.
    with contextlib.suppress(AttributeError, KeyError, ValueError):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {
        "coordinator_address": env["REVE_COORDINATOR"],
        "num_processes": ctx.num_processes,
        "process_id": ctx.process_id,
        # Our supervisor names every process; JAX must not guess from SLURM or other cluster variables.
        "cluster_detection_method": "deactivate",
        "initialization_timeout": int(float(env.get("REVE_INIT_TIMEOUT", "120"))),
        # A dead peer aborts the others after this; it stays above the supervisor's own heartbeat timeout so
        # the supervisor, not this cascade, tells which host failed.
        "heartbeat_timeout_seconds": int(float(env.get("REVE_JAX_HEARTBEAT_TIMEOUT", "30"))),
        "shutdown_timeout_seconds": int(float(env.get("REVE_SHUTDOWN_TIMEOUT", "30"))),
    }
    bind = coordinator_bind_address(env["REVE_COORDINATOR"])
    if bind and ctx.process_id == 0:
        kwargs["coordinator_bind_address"] = bind
    accepted = inspect.signature(jax.distributed.initialize).parameters
    mtls = sorted(k for k in env if k.startswith("JAX_MTLS_"))
    if mtls and not any(p.startswith("mtls_") for p in accepted):
        # Asked for a protected coordination service that this JAX cannot give: refuse rather than run open.
        raise RuntimeError(f"{mtls} set, but jax {jax.__version__} has no mTLS for jax.distributed (docs/elastic.md)")
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in accepted})


def _signal_handler(stop: threading.Event):
    """The one handler for SIGTERM/SIGINT, used by the worker and the trainer alike: the first asks for a clean
    stop (the loop saves a checkpoint and exits), a second one exits at once."""

    def handler(signum, _frame):
        if stop.is_set():
            print(f"signal {signum} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        print(f"signal {signum}: saving a checkpoint and stopping (again to exit now)", file=sys.stderr, flush=True)
        stop.set()

    return handler


def coordinator_bind_address(coordinator: str) -> str:
    """Returns the address JAX's coordination service should listen on: the coordinator's own address when it
    is an IP literal (127.0.0.1 locally, the host's address on a cluster), so the unauthenticated service is
    not offered on every interface; "" (JAX's default, all interfaces) for a host name, which may resolve
    differently here than on the other hosts."""
    host, _, port = coordinator.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return ""
    return f"{host}:{port}"


def _install_signal_handlers(stop: threading.Event) -> None:
    """Installed after jax.distributed joins, which installs JAX's own SIGTERM handler that this replaces."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _signal_handler(stop))


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event):
    """While inside: SIGTERM/SIGINT set `stop` (a second one exits at once); the previous handlers come back on
    exit. A no-op off the main thread (signals are delivered there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, _signal_handler(stop)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def any_process(flag: bool) -> bool:
    """Returns True on every process if `flag` is True on any: a collective, so every process calls it at the
    same step. Cheap for one process (no collective)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], dtype=np.int32))))

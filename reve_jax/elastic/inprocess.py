"""In-process recovery (`launch.py --in-process-recovery`): when a host's process exits, the others keep their
processes and go on as a smaller group instead of being killed and relaunched.

What JAX offers for it, checked with jax 0.10.2 on CPU (3 processes x 2 devices, gloo; docs/elastic.md):
- With `jax_enable_recoverability` the coordination service does not abort the survivors of a dead process.
- A collective with a dead peer then fails after `--xla_cpu_collective_timeout_seconds` with a JaxRuntimeError
  (gloo "Timed out waiting ... for recv"), instead of hanging. There is no call to cancel it sooner: the
  detection takes that timeout, which must also cover every legitimate wait in a collective (a peer still
  compiling its step), so it cannot be short.
- `multihost_utils.live_devices(devices)` (not exported as `jax.live_devices` in 0.10.2) is a barrier among the
  live processes and returns their devices; a collective over those devices works (gloo builds a new context).
- A restarted process can connect to the coordination service again, but a collective that includes it fails
  (the survivors' gloo pairs for that device set are stale): a host comes back only through a relaunch.
- `live_devices` asks the coordination service, which declares a killed process dead only after its
  heartbeat timeout (`heartbeat_timeout_seconds`): the launcher's default (>= 30 s, so that the supervisor and
  not JAX names a failed host) would make every in-process recovery wait that long, so under this flag the
  worker uses the collective timeout for it too.
- If process 0 dies, the coordination service dies with it and every process aborts: only the other hosts can be
  lost in-process.

So the policy (`PolicyConfig.in_process`) keeps the survivors only when the failed hosts exited (a crashed
process cannot write, so nothing needs fencing) and process 0's host is not among them; a lost or hung host, or
the coordinator's, is handled by the relaunch as before. The worker's side is below; the fake worker
(tests/elastic_fake_worker.py) uses it. The trainer does not: its disk checkpoints (Orbax's barriers and
saves), `any_process` and its data pipeline all span every process of the job, which a shrunk group no longer
has, so `trainer.run` refuses to start under the flag (`require_trainer_support`).
"""

from __future__ import annotations

import os

IN_PROCESS_ENV = "REVE_IN_PROCESS"
TIMEOUT_ENV = "REVE_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 30


class InProcessUnsupported(RuntimeError):
    """In-process recovery was asked for where it cannot work; the message says what to use instead."""


def enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(IN_PROCESS_ENV) == "1"


def configure(env) -> None:
    """Before jax.distributed.initialize and before any backend exists: survivors of a dead process are not
    aborted, a collective with a dead peer fails after REVE_COLLECTIVE_TIMEOUT seconds instead of hanging, and
    JAX declares a silent process dead after as long (REVE_JAX_HEARTBEAT_TIMEOUT in `env` is set to it)."""
    import jax

    try:
        jax.config.update("jax_enable_recoverability", True)
    except (AttributeError, KeyError) as e:  # a JAX without the option
        raise InProcessUnsupported(f"jax {jax.__version__} has no jax_enable_recoverability: {e}") from None
    timeout = int(float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    env["REVE_JAX_HEARTBEAT_TIMEOUT"] = str(timeout)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_timeout_seconds" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={timeout}".strip()


def live_devices(devices=None) -> list:
    """The devices of the processes still alive, in device-id order, agreed by every survivor (a barrier among
    them). Raises InProcessUnsupported when this JAX has no live_devices or the process group is gone."""
    import jax
    from jax.experimental import multihost_utils

    fn = getattr(multihost_utils, "live_devices", None) or getattr(jax, "live_devices", None)
    if fn is None:
        raise InProcessUnsupported(f"jax {jax.__version__} has no live_devices")
    with fn(list(devices if devices is not None else jax.devices())) as alive:
        return list(alive)


def leave(process_id: int, num_processes: int, timeout_s: float = 60.0) -> None:
    """A clean exit of a recoverable group. Its coordination service does not hold process 0's exit for the
    others (JAX skips the shutdown barrier for recoverable tasks), and a process whose shutdown call finds the
    service gone aborts: so the live processes meet at a barrier, the others disconnect, and process 0 (which
    hosts the service) returns only once they have."""
    import time

    from jax._src.distributed import global_state

    client = global_state.client
    if client is None or num_processes < 2:
        return
    live = sorted(client.get_live_nodes(list(range(num_processes))))
    client.wait_at_barrier("reve_jax_leave", int(timeout_s * 1000), process_ids=live)
    if process_id != 0:
        import jax

        jax.distributed.shutdown()
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(client.get_live_nodes(live)) > 1:
        time.sleep(0.05)


def rank(devices, process: int) -> tuple[int, int]:
    """(this process's rank, group size) among the processes owning `devices` (ranks in process order)."""
    procs = sorted({d.process_index for d in devices})
    return procs.index(process), len(procs)


def require_trainer_support(worker) -> None:
    """Raises InProcessUnsupported when the trainer runs under --in-process-recovery (see the module docstring)."""
    if getattr(worker, "in_process", False):
        raise InProcessUnsupported(
            "--in-process-recovery is not supported by the trainer yet: its disk checkpoints (Orbax's barriers), "
            "the stop agreement and the data pipeline span every process of the job, which a shrunk group no "
            "longer has. Launch without it: a failure relaunches the group, which restores from the in-memory "
            "snapshots (elastic.snapshot_every) in seconds (docs/elastic.md)."
        )

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

import dataclasses
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


KEY_PREFIX = "reve_jax/inprocess"


class Regroup(RuntimeError):
    """A collective failed but no process of the group was lost (a timeout on one side, or every side, of a
    collective among live peers). Its communicator is then broken on at least one side, and this JAX rebuilds
    none over the same processes (gloo: "Application timeout caused pair closure" on every later collective;
    a communicator is set up once per device set): the group must be relaunched. Every survivor raises it after
    the same agreement, so they exit together; the supervisor relaunches a group whose processes all exited with
    an error without striking any host. `step` is the last step every process completed."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclasses.dataclass(frozen=True)
class Round:
    """One in-process recovery's outcome, the same on every survivor."""

    devices: list  # the live devices, in device-id order
    step: int  # the last step every survivor completed: a process ahead of it rolls back to it


class Agreement:
    """Where the survivors go on from, agreed through the coordination service (process 0's, which outlives every
    in-process recovery: its loss ends the group).

    A collective can end on one side only: under CPU starvation a peer's gloo send timed out after the other side
    had received it and completed the all-reduce (seen once on a 2-core VM, docs/elastic.md). The side that failed
    recovers; the side that completed is a step ahead, and either trains on (its next collective fails too, after
    the timeout, since its peer is recovering) or has finished and is leaving. So that both end up in the same
    recovery at the same step:
    - `recover(step, devices)`, entered with the number of steps this process completed and the group's devices,
      marks a recovery of this round (a key per process), meets the other survivors in `live_devices`, publishes
      its step and reads theirs. It returns a `Round`: the live devices, the smallest step (the last one every
      survivor completed; a process ahead, by one step at most, rolls back to it, as a relaunch would roll back
      to its snapshot). With no process lost it raises `Regroup` instead, on every survivor.
    - `finish(step)`, called when the loop is done, publishes the final step and waits until every process of the
      group has finished (True: leave) or a peer marked a recovery of this round (False: the caller joins it).
    Every survivor goes through each round, so the round counters agree without being sent.
    """

    def __init__(self, process_id: int, num_processes: int, timeout_s: float = 60.0, client=None):
        if client is None:
            from jax._src.distributed import global_state

            client = global_state.client
        if client is None:
            raise InProcessUnsupported("in-process recovery needs jax.distributed to be initialized first")
        self.client = client
        self.process_id = process_id
        self.timeout_ms = int(timeout_s * 1000)
        self.round = 0
        self.members = set(range(num_processes))  # the group's processes since the last round

    def _key(self, *parts) -> str:
        return "/".join([KEY_PREFIX, str(self.round), *map(str, parts)])

    def recover(self, step: int, devices) -> Round:
        """Returns the `Round` every survivor agrees on; raises `Regroup` (on every survivor) when no process of
        `devices` was lost. See the class docstring."""
        devices = list(devices)
        self.client.key_value_set(self._key("recovering", self.process_id), str(step))
        alive = live_devices(devices)
        procs = sorted({d.process_index for d in alive})
        self.members = set(procs)
        self.client.key_value_set(self._key("step", self.process_id), str(step))
        steps = {p: int(self.client.blocking_key_value_get(self._key("step", p), self.timeout_ms)) for p in procs}
        self.round += 1
        agreed = min(steps.values())
        if max(steps.values()) - agreed > 1:
            raise RuntimeError(f"in-process recovery: the survivors completed steps {steps}, more than one apart")
        if {d.process_index for d in devices} <= self.members:
            raise Regroup(
                f"a collective failed with every process of the group alive (steps completed: {steps}); its "
                f"communicator cannot be rebuilt in-process, so the group exits for a relaunch from step {agreed}",
                agreed,
            )
        return Round(alive, agreed)

    def finish(self, step: int, poll_s: float = 0.02) -> bool:
        """True once every process of the group finished at `step`; False as soon as a peer marked a recovery of
        this round (the caller joins it). Raises when they finished at different steps or the wait passes the
        timeout (a peer that died after the last step: the supervisor relaunches, and the relaunch finds the run
        done). Polls keys only: `get_live_nodes` is a barrier among the processes it names (it is what makes
        `live_devices` one), so calling it in a loop would pair one process's calls with another's barrier."""
        import time

        self.client.key_value_set(self._key("finished", self.process_id), str(step))
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            if self.client.key_value_dir_get(self._key("recovering")):
                return False
            done = {int(k.rpartition("/")[2]): int(v) for k, v in self.client.key_value_dir_get(self._key("finished"))}
            if self.members <= done.keys():
                if {done[p] for p in self.members} != {step}:
                    raise RuntimeError(f"in-process group finished at different steps: {done}")
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-process group: processes {sorted(self.members - done.keys())} did not finish")
            time.sleep(poll_s)


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

"""Warm standby workers: a process per host that has started Python and imported JAX and the trainer, waiting
to be told which group it joins, so a relaunch does not pay for interpreter start-up and imports (seconds per
process, more when several start at once on few cores).

Supervisor side (`StandbyPool`): once a group trains, a standby is started on every host that may join the next
group, through the backend like a worker (the same command line, its host's devices, the run's secret) plus
REVE_STANDBY=<token>. Launching a group then hands a ready standby of each host its place (attempt, process id,
coordinator...) in the reply to its next beat; hosts without one get a fresh process as before.

Worker side (`wait_for_assignment`, called by `init_from_env`): imports REVE_STANDBY_IMPORTS, beats in phase
"standby" every 0.1 s (beats the policy never sees), and returns the group's variables once assigned; the
process then joins the group like any worker. It exits by itself when the supervisor is gone (orphan timeout).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import sys
import time

from reve_jax.elastic.channel import HeartbeatClient

RESTART_AFTER = 10.0  # s before a host's standby is started again (one that dies at once must not spin)
STANDBY_INTERVAL = 0.1  # s between a waiting standby's beats: bounds how long an assignment takes to arrive
# s: a standby silent for longer than this when the supervisor last read the channel is not handed a place (frozen,
# cut off, gone). Measured from that read, not from the launch: a supervisor busy between the two (killing a group,
# starting processes over ssh) must not make every standby look stale. 20 beat intervals, so that a standby starved
# of CPU for a moment on a loaded host still counts.
READY_WITHIN = 2.0


def wait_for_assignment(env, secret: bytes) -> dict:
    """Imports what the worker will need, then waits for the supervisor's assignment; returns its variables
    (REVE_ATTEMPT, REVE_PROCESS_ID, ...), already merged into `env`."""
    client = HeartbeatClient(
        env["REVE_HEARTBEAT"],
        {"host": env.get("REVE_HOST", ""), "standby": env["REVE_STANDBY"], "pid": os.getpid()},
        secret,
        interval=STANDBY_INTERVAL,
        orphan_timeout=float(env.get("REVE_ORPHAN_TIMEOUT", "0")),
    )
    client.update(-1, "warming")
    client.start()
    for name in filter(None, env.get("REVE_STANDBY_IMPORTS", "jax").split(",")):
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional module (TensorBoard): the worker does without it, or fails itself
            print(f"standby: cannot import {name} ({e})", file=sys.stderr, flush=True)
    client.update(-1, "standby")
    assignment = client.wait_assignment()
    client.close(flush=False)
    if not assignment:  # the supervisor dropped this standby (its ssh was lost, say): nothing to wait for
        print("standby: retired by the supervisor; exiting", file=sys.stderr, flush=True)
        os._exit(0)
    env.update(assignment)
    env.pop("REVE_STANDBY", None)
    print(f"standby: assigned to group {assignment.get('REVE_ATTEMPT')}", file=sys.stderr, flush=True)
    return assignment


@dataclasses.dataclass
class Standby:
    host: str
    token: str
    proc: object  # backends.Proc
    log_path: str
    last_beat: float | None = None
    ready: bool = False  # imports done


class StandbyPool:
    """The supervisor's standbys, at most one per host. `start` is backend.start; `argv` and `env` are a
    worker's (env with the run's secret); logs go to `log_dir`."""

    def __init__(self, start, argv: list[str], env: dict, log_dir: str, clock=time.monotonic):
        self._start, self.argv, self.env, self.log_dir, self.clock = start, argv, env, log_dir, clock
        self.by_host: dict[str, Standby] = {}
        self._by_token: dict[str, Standby] = {}
        self._count = itertools.count()
        self._last_start: dict[str, float] = {}
        self._exited: list[Standby] = []  # found exited by `take`, not yet handed back by `poll`

    def ensure(self, hosts: list[str]) -> None:
        """Starts a standby on each of `hosts` that has none (and had none started in the last RESTART_AFTER s)."""
        now = self.clock()
        for host in hosts:
            if host in self.by_host or now - self._last_start.get(host, -RESTART_AFTER) < RESTART_AFTER:
                continue
            self._last_start[host] = now
            token = f"s{next(self._count)}"
            log_path = os.path.join(self.log_dir, f"standby{token[1:]}_{host}.log")
            env = {**self.env, "REVE_STANDBY": token, "REVE_NUM_PROCESSES": "0", "REVE_HOST": host}
            s = Standby(host, token, self._start(host, list(self.argv), env, log_path), log_path)
            self.by_host[host] = self._by_token[token] = s

    def beat(self, t: float, msg: dict) -> None:
        s = self._by_token.get(msg.get("standby"))
        if s is not None:
            s.last_beat, s.ready = t, msg.get("phase") == "standby"

    def take(self, host: str, read_at: float | None = None) -> tuple[Standby | None, str]:
        """Removes and returns `host`'s standby if it is ready and had beat within READY_WITHIN s when the channel
        was last read (`read_at`, default now). Returns (the standby or None, why none: "" when one is returned)."""
        s = self.by_host.get(host)
        if s is None:
            return None, "none started"
        if not s.ready or s.last_beat is None:
            return None, "still importing"
        silent = (self.clock() if read_at is None else read_at) - s.last_beat
        if silent > READY_WITHIN:
            return None, f"silent for {silent:.1f} s"
        self._drop(s)
        if s.proc.poll() is not None:
            s.proc.kill()
            self._exited.append(s)  # handed back by the next poll, to be retired
            return None, "exited"
        return s, ""

    def ready(self, hosts: list[str]) -> bool:
        """Whether every one of `hosts` has a standby that has finished its imports."""
        return all(h in self.by_host and self.by_host[h].ready for h in hosts)

    def poll(self) -> list[Standby]:
        """Forgets standbys whose process exited (they are restarted by the next `ensure`) and returns them. Over
        ssh or srun the local process may exit while the remote one runs on (a host cut off the network): each is
        killed (the remote kill reaches it if the host is back) and the caller retires its token on the channel,
        which tells it to exit if it beats again."""
        dropped = [s for s in self.by_host.values() if s.proc.poll() is not None]
        for s in dropped:
            self._drop(s)
            s.proc.kill()
        dropped, self._exited = self._exited + dropped, []
        return dropped

    def close(self) -> list:
        """Kills every standby; returns their processes (to wait for)."""
        procs = [s.proc for s in self.by_host.values()]
        for p in procs:
            p.kill()
        self.by_host.clear()
        self._by_token.clear()
        return procs

    def _drop(self, s: Standby) -> None:
        self.by_host.pop(s.host, None)
        self._by_token.pop(s.token, None)

"""The elastic supervisor: a thin loop that turns what it observes into policy events and the policy's
decisions into backend actions.

Observations: beats from the heartbeat server, exit codes of worker and probe processes, SIGTERM/SIGINT, the
clock. Actions: launch a group (fresh coordinator port, one process per host), SIGKILL a group, ask it to stop
at the next checkpoint (through the heartbeat replies), probe a host, write an event. All decisions are in
`policy.Policy`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import time

from reve_jax.elastic import auth, fence
from reve_jax.elastic import policy as P
from reve_jax.elastic.backends import Backend
from reve_jax.elastic.channel import HeartbeatServer
from reve_jax.elastic.events import EventLog, read_events, summary
from reve_jax.elastic.precompile import AheadCompiler
from reve_jax.elastic.standby import StandbyPool

EXIT_FINISHED, EXIT_FAILED, EXIT_STOPPED = 0, 1, 2


@dataclasses.dataclass
class WorkerSettings:
    """What every worker is started with besides its place in the group."""

    argv: list[str]  # e.g. ["python", "scripts/train.py", "--config", C, "--workdir", W, ...]
    env: dict = dataclasses.field(default_factory=dict)  # extra variables (compilation cache, ...)
    heartbeat_interval: float = 0.5
    init_timeout: float = 120.0  # jax.distributed.initialize waits this long for every process
    orphan_timeout: float = 0.0  # workers exit when the supervisor is unreachable this long (0: never)
    probe_timeout: float = 120.0  # a probe running longer fails
    # Compiling ahead for the next group sizes (precompile.py): the job's argv and the CPU devices per host; off
    # when empty (GPU hosts, or a worker that is not the trainer).
    precompile_argv: list[str] = dataclasses.field(default_factory=list)
    devices_per_host: int = 0
    # Warm standbys (standby.py): modules a standby imports before it is given a place; "" = no standbys.
    standby_imports: str = ""


class Supervisor:
    """Runs a job on `backend` until it finishes, fails for good, or is stopped.

    Takes the backend, the worker settings, the policy config, `workdir` (events.jsonl and logs/ go there) and
    `hosts` (default: the backend's). `run()` returns the exit code: 0 finished, 2 stopped on request (launch
    again to resume), 1 failed.
    """

    def __init__(
        self,
        backend: Backend,
        worker: WorkerSettings,
        config: P.PolicyConfig,
        workdir: str,
        hosts: list[str] | None = None,
        poll_s: float = 0.05,
        clock=time.monotonic,
        verbose: bool = True,
    ):
        self.backend, self.worker, self.workdir = backend, worker, workdir
        self.hosts = list(hosts or backend.hosts)
        self.policy = P.Policy(self.hosts, config)
        self.poll_s, self.clock, self.verbose = poll_s, clock, verbose
        events_path = os.path.join(workdir, "events.jsonl")
        self._lock = _lock_workdir(workdir)
        try:
            self.fenced_below = fence.read_fence(workdir)
        except fence.FenceUnreadable as e:
            self._lock.close()
            raise RuntimeError(
                f"{e}. The supervisor must know which groups are fenced off before it numbers the next one: fix "
                f"the file's permissions or file system, or remove it if no worker of an earlier launch can still "
                f"run (then every old group may write again)."
            ) from None
        # A launch that resumes a run continues its attempt numbers, so logs and events stay apart; and never
        # below the fence (events.jsonl lost, truncated or not copied): a group numbered there would be fenced
        # off by its own launch.
        self.policy.next_attempt = max(_next_attempt(events_path), self.fenced_below)
        self.log = EventLog(events_path, clock)
        # Listen only where the workers reach us; a fresh secret per run proves a beat comes from one of them.
        self.server = HeartbeatServer(
            bind=backend.heartbeat_bind(), clock=clock, max_connections=max(64, 4 * len(self.hosts))
        )
        self.procs: dict[tuple[int, str], object] = {}  # (attempt, host) -> Proc, until reported gone
        self.probes: dict[str, tuple[object, float]] = {}  # host -> (Proc, start time)
        self.probe_count = 0
        self._pids_seen: set[tuple[int, str]] = set()
        self._signals = 0
        log_dir = os.path.join(workdir, "logs")
        self.ahead = None
        if worker.precompile_argv and worker.devices_per_host:
            self.ahead = AheadCompiler(worker.precompile_argv, worker.env, worker.devices_per_host, log_dir)
        self.standbys = None
        self._read_at: float | None = None  # when the channel was last read (a standby's silence is measured to it)
        self._standbys_logged = -1  # the group for which "every standby is ready" was recorded
        if worker.standby_imports:
            env = {**self._static_env(), "REVE_STANDBY_IMPORTS": worker.standby_imports}
            self.standbys = StandbyPool(backend.start, list(worker.argv), env, log_dir, clock)

    # ------------------------------------------------------------------------------------------------- loop
    def run(self) -> int:
        self.server.start()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._say(f"supervisor: {len(self.hosts)} hosts on {self.backend.name}, heartbeat port {self.server.port}")
        self.log.write(
            "start",
            {
                "hosts": self.hosts,
                "backend": self.backend.name,
                "config": dataclasses.asdict(self.policy.config),
            },
        )
        handled_signals = 0
        next_rejection_check = 0.0
        try:
            self._execute(self.policy.start(self.clock()))
            while self.policy.done is None:
                events: list[P.Event] = []
                for t, msg in self.server.drain():
                    if "standby" in msg:  # a standby waiting for a place: not a member of any group
                        if self.standbys is not None:
                            self.standbys.beat(t, msg)
                        continue
                    beat = _beat_from(t, msg)
                    if beat is not None:
                        self._note_pid(beat, msg)
                        events.append(beat)
                now = self._read_at = self.clock()
                for (attempt, host), proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is not None:
                        del self.procs[(attempt, host)]
                        events.append(P.Exit(now, attempt, host, code))
                events.extend(self._poll_probes(now))
                while handled_signals < self._signals:
                    handled_signals += 1
                    events.append(P.Preempt(now))
                events.append(P.Tick(now))
                for ev in events:
                    self._execute(self.policy.step(ev))
                self._prepare_next(now)
                if now >= next_rejection_check:  # at most one record a second, however many are dropped
                    next_rejection_check = now + 1.0
                    self._record_rejections()
                time.sleep(self.poll_s)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if self.ahead is not None:
                self.ahead.close()
            self._kill_everything()
            self._record_rejections()
            self.server.close()
        done = self.policy.done
        print(summary(self.log.records), flush=True)
        self.log.close()
        self._lock.close()
        return {"finished": EXIT_FINISHED, "preempted": EXIT_STOPPED}.get(done.status, EXIT_FAILED)

    def _prepare_next(self, now: float) -> None:
        """Once the group trains (its own start-up done, so nothing here slows it), get the next relaunch ready:
        a warm standby on every host that may join it, and the step compiled for the sizes it will likely have."""
        g = self.policy.group
        training = g is not None and g.mode == "running" and all(m.trained for m in g.members.values())
        if self.standbys is not None:
            for s in self.standbys.poll():  # its local ssh/srun gone: the remote standby must not live on
                self.server.retire(s.token)
            if training:
                usable = self.policy.usable()
                self.standbys.ensure(usable)
                if self.standbys.ready(usable) and self._standbys_logged != g.attempt:
                    self._standbys_logged = g.attempt
                    self.log.write("standby_ready", {"attempt": g.attempt, "hosts": usable})
        if self.ahead is None:
            return
        if training:
            self.ahead.done.add(len(g.hosts))  # this group's executables are in the cache now
            self.ahead.want(self.policy.likely_sizes())
        for rec in self.ahead.poll(now):
            self.log.write("precompile", rec)
            self._say(f"supervisor: compiled ahead for {rec['hosts']} hosts in {rec['seconds']} s (code {rec['code']})")

    def _note_pid(self, beat: P.Beat, msg: dict) -> None:
        """Records each worker's process id on its host once (remote pids are known from beats only)."""
        key = (beat.attempt, beat.host)
        if key in self.procs and key not in self._pids_seen and isinstance(msg.get("pid"), int):
            self._pids_seen.add(key)
            self.log.write("worker_pid", {"attempt": beat.attempt, "host": beat.host, "pid": msg["pid"]})

    def _record_rejections(self) -> None:
        rejected = self.server.take_rejections()
        if rejected:
            self.log.write("channel_rejected", rejected)
            self._say(f"supervisor: dropped unauthenticated or malformed channel messages {rejected}")

    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1

    # ---------------------------------------------------------------------------------------------- actions
    def _execute(self, actions: list[P.Action]) -> None:
        for a in actions:
            if isinstance(a, P.Launch):
                self._launch(a)
            elif isinstance(a, P.Kill):
                self._say(f"supervisor: killing group {a.attempt}: {a.reason}")
                self._fence(a.attempt + 1)  # first: a process the kill cannot reach must not write meanwhile
                for (attempt, _), proc in self.procs.items():
                    if attempt == a.attempt:
                        proc.kill()
            elif isinstance(a, P.RequestStop):
                self._say(f"supervisor: asking group {a.attempt} to stop ({a.reason})")
                self.server.request_stop(a.attempt)
            elif isinstance(a, P.Probe):
                self._probe(a.host)
            elif isinstance(a, P.Record):
                rec = self.log.write(a.kind, a.data)
                if a.kind in ("failure", "quarantine", "exclude", "readmit", "recovery", "waiting"):
                    self._say(f"supervisor: {rec}")

    def _fence(self, attempt: int) -> None:
        """Only groups numbered `attempt` and later may write to the run directory from now on (fence.py)."""
        if attempt <= self.fenced_below:
            return
        fence.write_fence(self.workdir, attempt)
        self.server.fence(attempt)
        self.fenced_below = attempt
        self.log.write("fence", {"attempt": attempt})

    def _static_env(self) -> dict:
        """The variables every worker (and standby) gets, whatever group it joins."""
        return {
            **self.worker.env,
            "REVE_HEARTBEAT": f"{self.backend.heartbeat_host()}:{self.server.port}",
            "REVE_HEARTBEAT_INTERVAL": str(self.worker.heartbeat_interval),
            "REVE_INIT_TIMEOUT": str(int(self.worker.init_timeout)),
            # JAX's own failure cascade must be slower than this supervisor's detection (see worker.py).
            "REVE_JAX_HEARTBEAT_TIMEOUT": str(int(max(30, 4 * self.policy.config.heartbeat_timeout))),
            "REVE_ORPHAN_TIMEOUT": str(self.worker.orphan_timeout),
            "REVE_WORKDIR": os.path.abspath(self.workdir),
            "PYTHONUNBUFFERED": "1",
            # Backends pass it out of band (environment, or stdin of ssh/srun), never on a command line.
            auth.SECRET_ENV: self.server.secret.hex(),
        }

    def _launch(self, a: P.Launch) -> None:
        self._fence(a.attempt)
        coordinator = self.backend.coordinator(a.hosts[0], a.attempt)
        pids, warm, cold = {}, [], {}
        for i, host in enumerate(a.hosts):
            env = {
                **self._static_env(),
                "REVE_COORDINATOR": coordinator,
                "REVE_NUM_PROCESSES": str(len(a.hosts)),
                "REVE_PROCESS_ID": str(i),
                "REVE_HOST": host,
                "REVE_ATTEMPT": str(a.attempt),
            }
            log_path = os.path.join(self.workdir, "logs", f"attempt{a.attempt}_{host}.log")
            s, why = self.standbys.take(host, self._read_at) if self.standbys is not None else (None, "")
            if why:
                cold[host] = why  # why the host gets a fresh process instead of its standby
            if s is not None:  # a warm standby takes the place: no interpreter start, no imports
                self.server.assign(s.token, {k: v for k, v in env.items() if k != auth.SECRET_ENV})
                proc = s.proc
                warm.append(host)
                with contextlib.suppress(OSError):
                    os.symlink(os.path.basename(s.log_path), log_path)
            else:
                proc = self.backend.start(host, list(self.worker.argv), env, log_path)
            self.procs[(a.attempt, host)] = proc
            pids[host] = proc.pid
        self.log.write(
            "spawn", {"attempt": a.attempt, "coordinator": coordinator, "pids": pids, "standby": warm, "cold": cold}
        )
        self._say(f"supervisor: group {a.attempt} on {len(a.hosts)} hosts {list(a.hosts)}, coordinator {coordinator}")

    def _probe(self, host: str) -> None:
        self.probe_count += 1
        log_path = os.path.join(self.workdir, "logs", f"probe{self.probe_count}_{host}.log")
        self.probes[host] = (self.backend.probe(host, dict(self.worker.env), log_path), self.clock())

    def _poll_probes(self, now: float) -> list[P.Event]:
        out = []
        for host, (proc, started) in list(self.probes.items()):
            code = proc.poll()
            if code is None and now - started > self.worker.probe_timeout:
                proc.kill()
                code = -9
            if code is not None:
                del self.probes[host]
                out.append(P.ProbeResult(now, host, code == 0))
        return out

    def _kill_everything(self) -> None:
        """On the way out (normal or not), leave no worker, standby or probe behind."""
        procs = list(self.procs.values()) + [p for p, _ in self.probes.values()]
        if self.standbys is not None:
            procs += self.standbys.close()
        for proc in procs:
            proc.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for proc in procs:  # remote kills (ssh, scancel) finish, so nothing of the run is left on the hosts
            thread = getattr(proc, "killing", None)
            if thread is not None:
                thread.join(timeout=max(0.0, deadline + 5 - time.monotonic()))

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text, flush=True)


def _beat_from(t: float, msg: dict) -> P.Beat | None:
    """Returns the policy event for one heartbeat message, or None if it is malformed."""
    try:
        start = msg.get("start_step")
        return P.Beat(
            t,
            int(msg["attempt"]),
            str(msg["host"]),
            int(msg["step"]),
            str(msg.get("phase", "train")),
            None if start is None else int(start),
            str(msg.get("where", "")),
            bool(msg.get("joined", False)),
            float(msg.get("compile_s", 0.0)),
            int(msg.get("restarts", 0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _lock_workdir(workdir: str):
    """Holds an exclusive lock on `<workdir>/.supervisor.lock` for this supervisor's life (returns the open file);
    raises RuntimeError if another supervisor holds it: two would both write events and launch groups."""
    os.makedirs(workdir, exist_ok=True)
    f = open(os.path.join(workdir, ".supervisor.lock"), "a")  # noqa: SIM115 (held until the run ends)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RuntimeError(f"another launcher is running on {workdir}") from None
    return f


def _next_attempt(events_path: str) -> int:
    """Returns one more than the last attempt launched in an earlier run's events file (0 if none)."""
    if not os.path.exists(events_path):
        return 0
    launched = [r["attempt"] for r in read_events(events_path) if r.get("event") == "launch"]
    return max(launched, default=-1) + 1

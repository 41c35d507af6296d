"""A discrete-event simulation of the elastic supervisor on a large cluster.

The decisions are the supervisor's own: every detection, quarantine, probe, re-admission, stop and relaunch
comes from `reve_jax.elastic.policy.Policy`, fed with the events a real supervisor would see (heartbeats,
exits, probe results, clock ticks). What is simulated is everything else: the hosts (a failure trace drawn
ahead, `cluster.draw_trace`), the processes (launch, connect, restore, compile, train, save, exit) and the
clock. Time jumps from event to event; nothing is stepped per second.

What keeps 1,250 hosts x 30 days fast, and where the simulation shortcuts the real supervisor:
- Heartbeats are sent only when the policy is about to look at them (before any event it is fed, at most
  every heartbeat_timeout/2, and at once on a fault or a phase change), not every 0.5 s. A policy step
  checks every member's last beat, so nothing it decides depends on the beats in between.
- The policy has no batched input: each `step` runs its O(hosts) clock checks, so 1,250 beats through
  `step` would cost O(hosts^2). A batch of beats or exits that arrive at one instant goes through the
  policy's own per-event handlers (`Policy._on_beat`, `Policy._on_exit`), followed by one `Tick` through
  `step` - what the supervisor does when one poll drains many messages, minus the clock checks in between,
  which find nothing at one instant (see `_bulk` for the two per-member scans deferred to the batch's last
  event). If those handlers are renamed, each event goes through `step` (correct, but slow).
- A probe of a host that is still broken is not answered with a failure every probe interval: the one probe
  is answered when the first of those repeated probes would pass. The host becomes ready at the same time.
- A killed group is taken down by the policy's own kill timeout (set to `kill_s`) rather than by reporting
  1,250 exits; a clean stop does report every exit (code 0), as it must to count as stopped.

Accounting: every GPU-second of the horizon lands in exactly one (mechanism, cause) bucket; `productive` is
the time that produced steps that were kept (saved in a checkpoint that the run later restored or kept).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import Counter, defaultdict

from reve_jax.elastic import policy as P
from reve_jax.tools.plan.cluster import CRASH, HANG, SLOW, ClusterConfig, Trace, draw_trace, policy_config

EPS = 1e-3  # a tick this long after a timeout (the policy's timeouts are strict inequalities)
# The mechanism a group's GPU time is lost to in each stage that is not training.
STAGE_LOSS = {
    "launch": "restart",
    "restore": "restore",
    "startup": "startup",
    "stalled": "detection",
    "killing": "restart",
    "stopping": "checkpoint",
    "recovering": "restart",  # in-process: the survivors wait out the collective timeout and rebuild in place
}
MECHANISMS = (
    "productive",
    "checkpoint",
    "snapshot",
    "rework",
    "detection",
    "restart",
    "restore",
    "startup",
    "slow",
    "hosts_out",
    "waiting",
    "stopped",
)


@dataclasses.dataclass
class _Group:
    """What the simulation knows of one launched group (the policy keeps its own view)."""

    attempt: int
    hosts: tuple[str, ...]
    launch_t: float
    restored_step: int
    stage: str = "launch"  # launch | restore | startup | train | stopping | stalled | killing
    spawned: bool = False
    beat: tuple[int, str, int | None] = (-1, "starting", None)  # what members report: step, phase, start step
    step: float = 0.0  # steps done, fractional while computing
    save_end: float | None = None  # a periodic save in progress ends here
    uncommitted: float = 0.0  # GPU-s of work since the last checkpoint: lost on a failure
    step_s: float = 0.0
    slowdown: float = 1.0
    f_slow: float = 0.0  # shares of a step's time a straggler and the snapshots add
    f_snap: float = 0.0
    restarts: int = 0  # in-process recoveries of this group (the workers' beats count them)
    silent: set = dataclasses.field(default_factory=set)  # send no beats (lost, or never started)
    hung: set = dataclasses.field(default_factory=set)
    slow: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class SimResult:
    """What one simulated run produced. GPU-hours per mechanism and per cause sum to the horizon's."""

    config: ClusterConfig
    policy: str
    goodput: float  # productive GPU time / all GPU time (spares included)
    gpu_hours: dict  # mechanism -> GPU-hours
    lost_by_cause: dict  # cause -> GPU-hours lost (everything but productive and hosts_out)
    kept_steps: int
    faults: dict  # kind -> faults in the trace
    hits: dict  # kind -> faults that struck a host of the running group
    records: dict  # policy record kind -> count (failure, quarantine, readmit, recovery, ...)
    recovery_s: dict  # cause -> mean seconds from fault to the first step of the new group
    detection_s: dict  # the policy's failure reason -> mean seconds from fault to detection
    hosts_down: tuple[int, float]  # (max, mean) hosts broken at once (the trace)
    hosts_out: tuple[int, float]  # (max, mean) hosts outside the training group (all of them while waiting)
    finish: str  # "" while running at the horizon, else the policy's finish status and reason
    policy_steps: int
    runtime_s: float
    restores: dict = dataclasses.field(default_factory=dict)  # "disk" | "peers" -> restores (the first launch's too)


class Simulator:
    """Runs the policy `policy` ("isolate" or "restart-all") against the trace of `c` (or `trace`)."""

    def __init__(self, c: ClusterConfig, policy: str = "isolate", trace: Trace | None = None):
        self.c = c
        self.policy_name = policy
        self.trace = trace if trace is not None else draw_trace(c)
        self.names = [f"h{i:05d}" for i in range(c.total_hosts)]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.policy = P.Policy(self.names, policy_config(c, policy))
        self.queue: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.group: _Group | None = None
        self.kept_step = 0  # what the next group restores: the newest checkpoint, or a surviving snapshot
        self.disk_step = 0  # the newest checkpoint on disk
        self.from_peers = False  # the next restore reads snapshots from host memory, not the disk
        self.restores: Counter = Counter()  # "disk" | "peers" -> restores
        self.cause = "initial"  # what the current loss of time is charged to
        self.gpu_s: dict = defaultdict(float)  # (mechanism, cause) -> GPU-seconds
        self.records: Counter = Counter()
        self.hits: Counter = Counter()
        self.recoveries: list[dict] = []
        self.detections: list[tuple[str, float]] = []  # (the policy's failure reason, detection seconds)
        self.last_refresh = -math.inf
        self.out_area, self.out_max = 0.0, 0
        self.steps_fed = 0

    # -------------------------------------------------------------------------------------------------- run
    def run(self) -> SimResult:
        """Simulates the horizon; returns the accounting."""
        wall0 = time.perf_counter()
        horizon = self.c.horizon_s
        for f in self.trace.faults:
            self._at(f.t, "fault", f)
            if f.kind == SLOW:
                self._at(f.degraded_until, "drain", f)
        self._execute(self.policy.start(0.0))
        while self.queue and self.policy.done is None:
            t, _, kind, data = heapq.heappop(self.queue)
            if t > horizon:
                break
            self._advance(t)
            getattr(self, f"_on_{kind}")(data)
        self._advance(horizon)
        g = self.group
        if g is not None and g.stage == "train":  # work since the last save would be saved at the end
            self._add("productive", "none", g.uncommitted)
            self.kept_step = max(self.kept_step, int(g.step))
        return self._result(time.perf_counter() - wall0)

    def _at(self, t: float, kind: str, data=None) -> None:
        heapq.heappush(self.queue, (t, next(self._seq), kind, data))

    def _tick_at(self, t: float) -> None:
        self._at(t + EPS, "tick")

    # ----------------------------------------------------------------------------------------- accounting
    def _add(self, mechanism: str, cause: str, gpu_s: float) -> None:
        if gpu_s > 0:
            self.gpu_s[(mechanism, cause)] += gpu_s

    def _advance(self, t: float) -> None:
        """Moves the clock to t, charging every GPU-second in between to its bucket."""
        dt = t - self.now
        if dt <= 0:
            return
        gpus, total = self.c.gpus_per_host, self.c.total_hosts
        g = self.group
        if self.policy.done is not None:
            self._add("stopped", "none", total * gpus * dt)
            out = total
        elif g is None:
            self._add("waiting", self.cause, total * gpus * dt)
            out = total
        else:
            n = len(g.hosts)
            out = total - n
            self._add("hosts_out", "none", out * gpus * dt)
            if g.stage == "train":
                self._compute(g, t)
            else:
                cause = "readmit" if g.stage == "stopping" else self.cause
                self._add(STAGE_LOSS[g.stage], cause, n * gpus * dt)
        self.out_area += out * dt
        self.out_max = max(self.out_max, out)
        self.now = t

    def _compute(self, g: _Group, t: float) -> None:
        """Trains group g from self.now to t: steps, and a blocking save every ckpt_every steps."""
        rate = len(g.hosts) * self.c.gpus_per_host
        k = self.c.ckpt_every
        now = self.now
        while now < t:
            if g.save_end is not None:
                end = min(g.save_end, t)
                self._add("checkpoint", "none", rate * (end - now))
                now = end
                if end == g.save_end:  # the save is complete: its steps are kept
                    g.save_end = None
                    self.kept_step = self.disk_step = int(g.step)
                    self._add("productive", "none", g.uncommitted)
                    g.uncommitted = 0.0
                continue
            target = (math.floor(g.step / k + 1e-9) + 1) * k
            reach = now + (target - g.step) * g.step_s
            end = min(reach, t)
            work = rate * (end - now)
            g.uncommitted += work * (1 - g.f_slow - g.f_snap)
            self._add("slow", "slow", work * g.f_slow)
            self._add("snapshot", "none", work * g.f_snap)
            if end == reach:
                g.step = float(target)
                g.save_end = end + self.c.ckpt_save_s
            else:
                g.step += (end - now) / g.step_s
            now = end

    def _set_rate(self, g: _Group) -> None:
        c = self.c
        g.slowdown = c.slow_factor if g.slow else 1.0
        base = c.step_s * c.hosts / len(g.hosts)  # fixed global batch: fewer hosts, longer steps
        # A snapshot blocks snapshot_save_s at full size; each host's share of the state grows as hosts leave.
        snap = c.snapshot_save_s * c.hosts / len(g.hosts) / c.snapshot_every if c.snapshot_every else 0.0
        g.step_s = base * g.slowdown + snap
        g.f_slow, g.f_snap = base * (g.slowdown - 1) / g.step_s, snap / g.step_s

    def _surviving_snapshot(self, g: _Group, failed: str | None) -> int | None:
        """The step a snapshot lets the next group restore after `failed` broke group g, or None (the disk).

        The newest snapshot counts once complete (a step after it was taken: the pieces are still on their way to
        the successor meanwhile); the state the group restored is still in the stores until a newer one replaces
        it. A failed host's pieces survive on its ring successor unless that host is down too."""
        k = self.c.snapshot_every
        if not k:
            return None
        snap = max(math.floor((g.step - 1) / k) * k, g.restored_step)
        if snap <= self.disk_step:
            return None
        if failed is not None and failed in g.hosts:
            succ = g.hosts[(g.hosts.index(failed) + 1) % len(g.hosts)]
            if succ != failed and self.trace.state(self.index[succ], self.now) == "down":
                return None
        return int(snap)

    def _stall(self, g: _Group, cause: str, failed: str | None = None) -> None:
        """A fault (on host `failed`) stops group g: work since the last checkpoint, or since the last surviving
        snapshot, is lost; time until the kill is detection."""
        if g.stage in ("stalled", "killing"):
            return
        if g.stage in ("train", "stopping"):
            snap = self._surviving_snapshot(g, failed)
            lost = g.uncommitted
            if snap is not None:  # the steps up to the snapshot are kept
                per_step = len(g.hosts) * self.c.gpus_per_host * g.step_s * (1 - g.f_slow - g.f_snap)
                lost = min(g.uncommitted, max(0.0, g.step - snap) * per_step)
                self._add("productive", "none", g.uncommitted - lost)
                self.kept_step = snap
            self.from_peers = snap is not None
            self._add("rework", cause, lost)
            g.uncommitted, g.save_end = 0.0, None
            g.beat = (int(g.step), "train", g.restored_step)
        g.stage = "stalled"
        self.cause = cause

    # ------------------------------------------------------------------------------------ policy plumbing
    def _feed(self, ev) -> None:
        self.steps_fed += 1
        self._execute(self.policy.step(ev))
        if self.policy.group is None:  # taken down with no relaunch: the policy waits for hosts
            self.group = None

    def _report(self, g: _Group) -> tuple[int, str, int | None]:
        if g.stage in ("train", "stopping"):
            return int(g.step), "train", g.restored_step
        return g.beat

    def _refresh(self, force: bool = False) -> None:
        """Heartbeats of every member still beating, at self.now (see the module docstring)."""
        g = self.group
        if g is None or not g.spawned or g.stage == "killing":
            return
        if not force and self.now - self.last_refresh < self.c.heartbeat_timeout / 2:
            return
        step, phase, start = self._report(g)
        beats = [
            P.Beat(self.now, g.attempt, h, step, phase, start, "hung" if h in g.hung else "wait", restarts=g.restarts)
            for h in g.hosts
            if h not in g.silent
        ]
        self._bulk(beats, "_on_beat")
        self.last_refresh = self.now

    def _bulk(self, events: list, handler: str) -> None:
        """Events that arrive at one instant, through the policy's per-event handler, then one Tick.

        Two of the policy's per-event checks scan every member (is a recovery complete; is anyone still
        live). At one instant their answer can only change with the last event of the batch, so they are
        deferred to it: the recovery record is held back and `live()` reports someone live until then. The
        actions and records are the same as event by event, in O(members) instead of O(members^2)."""
        fn = getattr(self.policy, handler, None)
        g = self.policy.group
        if fn is None or g is None or not hasattr(self.policy, "recovery") or not events:
            for ev in events:
                self._feed(ev)
            return
        out: list = []
        *head, last = events
        recovery, self.policy.recovery = self.policy.recovery, None
        g.live = lambda: [None]
        try:
            for ev in head:
                fn(ev, out)
        finally:
            del g.live
            self.policy.recovery = recovery
        fn(last, out)
        self._execute(out)
        self._feed(P.Tick(self.now))

    def _execute(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, P.Launch):
                self._launch(a)
            elif isinstance(a, P.Kill):
                self._kill(a)
            elif isinstance(a, P.RequestStop):
                self._request_stop(a)
            elif isinstance(a, P.Probe):
                self._probe(a.host)
            elif isinstance(a, P.Record):
                self.records[a.kind] += 1
                if a.kind == "recovery":
                    self.recoveries.append(a.data)
                elif a.kind == "failure":
                    self.detections.append((a.data["reason"], a.data["detection_s"]))
                elif a.kind == "quarantine":
                    self._tick_at(self.now + self.c.probe_interval)  # the policy probes it then
                elif a.kind == "shrink":
                    self._shrink(a.data)

    # ------------------------------------------------------------------------------------------ actions
    def _launch(self, a: P.Launch) -> None:
        self.group = _Group(a.attempt, a.hosts, self.now, self.kept_step)
        self._at(self.now + self.c.spawn_s, "milestone", (a.attempt, "spawn"))

    def _kill(self, a: P.Kill) -> None:
        g = self.group
        if g is None or g.attempt != a.attempt:
            return
        self._stall(g, self.cause)
        g.stage = "killing"
        self._tick_at(self.now + self.c.kill_s)  # the policy's kill timeout takes the group down

    def _shrink(self, data: dict) -> None:
        """In-process recovery: the survivors keep their processes. They notice the dead peer when their
        collective times out (counted from the fault, which the exit window already covers), restore in place
        (from the snapshots' copies, else the disk) and compile for the smaller mesh."""
        g, c = self.group, self.c
        if g is None or g.attempt != data["attempt"]:
            return
        lost = set(data["lost"])
        g.hosts = tuple(data["hosts"])
        for s in (g.silent, g.hung, g.slow):
            s -= lost
        g.restarts += 1
        g.restored_step = self.kept_step
        g.stage, g.beat = "recovering", (self.kept_step, "compiling", self.kept_step)
        self.restores["peers" if self.from_peers else "disk"] += 1
        wait = max(0.0, c.collective_timeout_s - c.exit_window)
        restore = c.snapshot_restore_s if self.from_peers else c.restore_s
        self._at(self.now + wait + restore + c.first_step_s, "milestone", (g.attempt, "trained"))

    def _request_stop(self, a: P.RequestStop) -> None:
        g = self.group
        if g is None or g.attempt != a.attempt or g.stage != "train":
            return
        g.stage, g.save_end = "stopping", None
        self._at(self.now + self.c.stop_save_s, "stopped", a.attempt)

    def _probe(self, host: str) -> None:
        c = self.c
        done = self.trace.next_passing_probe(self.index[host], self.now, c.probe_s, c.probe_interval)
        if done is not None:
            self._at(done, "probe", host)

    # ------------------------------------------------------------------------------------------- events
    def _on_tick(self, _) -> None:
        self._refresh()
        self._feed(P.Tick(self.now))

    def _on_probe(self, host: str) -> None:
        self._refresh()
        self._feed(P.ProbeResult(self.now, host, True))

    def _on_fault(self, f) -> None:
        g, c = self.group, self.c
        name = self.names[f.host]
        if g is None or name not in g.hosts or g.stage == "killing" or name in g.silent:
            return
        self.hits[f.kind] += 1
        if f.kind == SLOW:
            g.slow.add(name)
            if g.stage in ("train", "stopping"):
                self._set_rate(g)
            return  # it is drained at f.degraded_until
        self._stall(g, f.kind, name)
        self._refresh(force=True)  # every member's last beat is now, this host's too
        if f.kind == CRASH:
            self._feed(P.Exit(self.now, g.attempt, name, -6))
            self._tick_at(self.now + c.exit_window)
            return
        if f.kind == HANG and g.spawned:
            g.hung.add(name)
            grace = c.progress_timeout if g.beat[1] == "train" else c.startup_timeout
            self._tick_at(self.now + grace)
            return
        g.silent.add(name)  # lost, or hung before its first beat
        self._tick_at(self.now + c.heartbeat_timeout if g.spawned else g.launch_t + c.startup_timeout)

    def _on_drain(self, f) -> None:
        """The outside monitor kills a straggler's process (the policy sees a failed exit)."""
        g = self.group
        name = self.names[f.host]
        if g is None or name not in g.slow or g.stage == "killing" or name in g.silent:
            return
        self._stall(g, SLOW, name)
        self._refresh(force=True)
        self._feed(P.Exit(self.now, g.attempt, name, -9))
        self._tick_at(self.now + self.c.exit_window)

    def _on_milestone(self, data) -> None:
        attempt, what = data
        g, c = self.group, self.c
        if g is None or g.attempt != attempt or g.stage == "killing":
            return
        if what == "spawn":  # processes start and beat, also in a group a fault already stopped
            g.spawned = True
            states = {h: self.trace.state(self.index[h], self.now) for h in g.hosts}
            g.slow = {h for h, s in states.items() if s == "slow"}
            dead = [h for h, s in states.items() if s == "down" and h not in g.silent]
            if dead:  # a host broke while it waited: its process cannot start
                self._stall(g, CRASH, dead[0])
                g.silent.update(dead)
                self._refresh(force=True)
                self._bulk([P.Exit(self.now, attempt, h, 255) for h in dead], "_on_exit")
                self._tick_at(self.now + c.exit_window)
                return
            if g.stage != "stalled":
                self._at(g.launch_t + c.restart_s, "milestone", (attempt, "connect"))
        elif g.stage == "stalled":
            return
        elif what == "connect":  # only the reported phase changes: no decision needs it at once
            g.stage, g.beat = "restore", (-1, "restoring", None)
            self.restores["peers" if self.from_peers else "disk"] += 1
            restore_s = c.snapshot_restore_s if self.from_peers else c.restore_s
            self._at(self.now + restore_s, "milestone", (attempt, "restored"))
            return
        elif what == "restored":
            g.stage, g.beat = "startup", (g.restored_step, "compiling", g.restored_step)
            self._at(self.now + c.first_step_s, "milestone", (attempt, "trained"))
        elif what == "trained":
            g.stage, g.step = "train", float(g.restored_step + 1)
            self._set_rate(g)
            self.cause = "none"
        self._refresh(force=True)
        self._feed(P.Tick(self.now))

    def _on_stopped(self, attempt: int) -> None:
        """A clean stop's save is done: the work is kept, and every process exits 0."""
        g = self.group
        if g is None or g.attempt != attempt or g.stage != "stopping":
            return
        self.kept_step = self.disk_step = int(g.step)
        self.from_peers = False
        self._add("productive", "none", g.uncommitted)
        g.uncommitted = 0.0
        g.stage = "stalled"  # down until the relaunch (no time passes here)
        self.cause = "readmit"
        self._bulk([P.Exit(self.now, attempt, h, 0) for h in g.hosts if h not in g.silent], "_on_exit")

    # ------------------------------------------------------------------------------------------- result
    def _result(self, runtime_s: float) -> SimResult:
        c = self.c
        hours = lambda s: s / 3600.0
        by_mech: dict = defaultdict(float)
        by_cause: dict = defaultdict(float)
        for (mech, cause), s in self.gpu_s.items():
            by_mech[mech] += hours(s)
            if mech not in ("productive", "hosts_out"):
                by_cause[cause] += hours(s)
        total = c.total_hosts * c.gpus_per_host * c.horizon_s
        rec: dict = defaultdict(list)
        for r in self.recoveries:
            rec[r["cause"]].append(r["total_s"])
        det: dict = defaultdict(list)
        for reason, s in self.detections:
            det[reason].append(s)
        done = self.policy.done
        return SimResult(
            config=c,
            policy=self.policy_name,
            goodput=self.gpu_s.get(("productive", "none"), 0.0) / total,
            gpu_hours={m: by_mech.get(m, 0.0) for m in MECHANISMS},
            lost_by_cause=dict(sorted(by_cause.items(), key=lambda kv: -kv[1])),
            kept_steps=self.kept_step,
            faults=dict(Counter(f.kind for f in self.trace.faults)),
            hits=dict(self.hits),
            records=dict(self.records),
            recovery_s={k: sum(v) / len(v) for k, v in rec.items()},
            detection_s={k: sum(v) / len(v) for k, v in det.items()},
            hosts_down=self.trace.down_stats(),
            hosts_out=(self.out_max, self.out_area / c.horizon_s),
            finish="" if done is None else f"{done.status}: {done.reason}",
            policy_steps=self.steps_fed,
            runtime_s=runtime_s,
            restores=dict(self.restores),
        )


def simulate(c: ClusterConfig, policy: str = "isolate", trace: Trace | None = None) -> SimResult:
    """Runs one simulation of `c` under `policy`; returns its SimResult."""
    return Simulator(c, policy, trace).run()


def checkpoint_bound(c: ClusterConfig) -> float:
    """Goodput without failures: the first launch's start-up, then a blocking save every ckpt_every steps."""
    start = c.restart_s + c.restore_s + c.first_step_s
    interval = c.ckpt_every * c.step_s
    return max(0.0, c.horizon_s - start) / c.horizon_s * interval / (interval + c.ckpt_save_s)

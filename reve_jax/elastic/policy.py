"""The elastic policy: which hosts train, when the group stops or relaunches, when a repaired host rejoins.

Pure and deterministic: `Policy.step(event)` takes one observation stamped with the caller's clock (a
heartbeat, a process exit, a probe result, a clock tick, a preemption) and returns the actions to take
(launch, kill, ask to stop, probe, record, finish). It does no I/O and reads no clock, so the supervisor
drives it from real processes and a cluster simulator can drive the same code from simulated ones.

Host states: healthy (may train), quarantined (failed; probed until a probe passes, then re-admitted at the
next launch), excluded (failed `max_strikes` times; never used again). A group is one launch (an "attempt") of
one process per host; it is running, stopping (asked to stop cleanly at the next checkpoint) or killing.
"""

from __future__ import annotations

import dataclasses
import signal
from collections import Counter
from collections.abc import Sequence

from reve_jax.elastic.messages import (  # noqa: F401  (re-exported: the policy's interface)
    Action,
    Beat,
    Event,
    Exit,
    Finish,
    Kill,
    Launch,
    Preempt,
    Probe,
    ProbeResult,
    Record,
    RequestStop,
    Tick,
)

HEALTHY, QUARANTINED, EXCLUDED = "healthy", "quarantined", "excluded"
EXITING = "exiting"  # the phase of a worker's last beat, sent by WorkerContext.close()
LOST_REASONS = ("heartbeat lost", "no heartbeat after launch")  # unreachable: a kill may not reach the process
EXIT_FENCED = -1000  # a lost member's stand-in exit code: not waited for, fenced off instead
# Phases a worker reports before its state is restored: it has no meaningful step yet.
PRE_RESTORE_PHASES = ("warming", "standby", "starting", "joining", "restoring")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    min_hosts: int = 1  # below this many usable hosts the policy waits (probing) instead of training
    max_strikes: int = 3  # failures after which a host is excluded for good
    group_sizes: tuple[int, ...] = ()  # allowed hosts per group (e.g. so the global batch divides); () = any
    heartbeat_timeout: float = 5.0  # s without a beat after the first one: the host is lost
    startup_timeout: float = 300.0  # s to the first beat, and without progress in a phase other than "train"
    progress_timeout: float = 60.0  # s at one step in phase "train": the host is hung
    hang_slack: float = 5.0  # hosts stuck within this many s of each other are stuck in one collective
    exit_window: float = 0.5  # s to collect further exits after the first failed one, before blaming
    stop_timeout: float = 120.0  # s for a clean stop (besides the time to the next checkpoint) before a kill
    kill_timeout: float = 15.0  # s for killed processes to be reported gone
    probe_interval: float = 10.0  # s between probes of a quarantined host
    readmit: bool = True  # re-admit quarantined hosts whose probe passes
    ckpt_every: int = 0  # the trainer's checkpoint cadence in steps (0: unknown), bounds a clean stop
    total_steps: int = 0  # the run's length (0: unknown); no re-admission in the last checkpoint interval
    max_failures_without_progress: int = 5  # failures in a row that get no further than before: give up
    # Re-admission by cost: stop the group for a repaired host only when the added hosts would train longer before
    # the next failure-driven relaunch (expected MTBF / group size) than the stop idles the whole group (the mean
    # of this run's measured relaunches, old group gone -> first step; relaunch_estimate_s until one is measured).
    # Otherwise the ready hosts wait and join at the next relaunch for free. The MTBF is host_mtbf_s as a prior
    # worth host_mtbf_weight failures, updated with the run's own failures and host-seconds
    # (`Policy.host_mtbf_estimate`), so a wrong guess fades as failures are seen (a huge weight: never learn).
    # host_mtbf_s = 0 (unknown): re-admit at once.
    host_mtbf_s: float = 0.0
    host_mtbf_weight: float = 1.0
    relaunch_estimate_s: float = 300.0
    # The supervisor fences a killed group off the run directory (fence.py), so a host lost by heartbeat (cut
    # off, frozen) need not be reported gone before the next group starts: the kill may never reach it.
    fenced: bool = False
    # In-process recovery (inprocess.py): when the failed hosts exited and process 0's host is not one of them, the
    # survivors keep their processes and go on as a smaller group (same attempt) if that size is allowed; anything
    # else (a lost or hung host, the coordinator's, a size not allowed) relaunches as before.
    in_process: bool = False


# ---------------------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class HostState:
    status: str = HEALTHY
    strikes: int = 0
    ready: bool = False  # quarantined and its last probe passed: joins at the next launch
    probing: bool = False
    next_probe_t: float = 0.0


@dataclasses.dataclass
class Member:
    """What the policy knows of one worker of the current group."""

    host: str
    launched_t: float
    first_beat_t: float | None = None
    last_beat_t: float | None = None
    progress_t: float = 0.0  # last change of step or phase
    step: int = -1
    phase: str = "launched"
    start_step: int | None = None
    where: str = ""
    trained: bool = False  # finished a step beyond its start step
    joined_t: float | None = None  # first beat after joining the JAX process group
    compile_s: float = 0.0  # the worker's compile seconds so far (cumulative, from its beats)
    compile_at_restore: float | None = None  # ... when it reported its restored step
    exit_code: int | None = None
    exit_t: float | None = None
    restarts: int = 0  # beats from before this many in-process restarts carry a stale start step
    seen_restarts: int = 0  # the worker's in-process restarts, as its beats report them


@dataclasses.dataclass
class Group:
    attempt: int
    hosts: tuple[str, ...]
    launched_t: float
    members: dict[str, Member]
    mode: str = "running"  # running | stopping | killing
    stop_reason: str = ""
    deadline: float = 0.0  # of a clean stop, or of a kill
    first_failed_exit_t: float | None = None
    max_step: int = -1
    rate_t0: tuple[float, int] | None = None  # (time, step) of the first train beat, for the step rate

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.exit_code is None]


@dataclasses.dataclass
class Recovery:
    """Timing of one relaunch, from the fault to the first step of the new group."""

    cause: str
    hosts: tuple[str, ...]
    fault_t: float
    detect_t: float
    last_step: int
    attempt: int = -1  # the group that recovers
    down_t: float | None = None  # the old group is gone (killed, or stopped cleanly)
    launch_t: float | None = None
    connected_t: float | None = None
    joined_t: float | None = None
    restored_t: float | None = None
    restored_step: int | None = None
    relaunches: int = 0


class Policy:
    """Decisions of the elastic supervisor: feed every observation to `step`, execute the actions returned."""

    def __init__(self, hosts: Sequence[str], config: PolicyConfig = PolicyConfig()):
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct and non-empty, got {list(hosts)}")
        self.config = config
        self.order = tuple(hosts)
        self.hosts = {h: HostState() for h in hosts}
        self.group: Group | None = None
        self.next_attempt = 0
        self.recovery: Recovery | None = None
        self.preempted = False
        self.done: Finish | None = None
        self.failures_without_progress = 0
        self.best_step = -1
        self.waiting_since: float | None = None
        self.relaunch_s: list[float] = []  # measured relaunches: old group gone -> the new group's first step
        self.exposure_s = 0.0  # host-seconds spent in launched groups (the failure rate's denominator)
        self.group_failures = 0  # failures that brought a group down (each one costs a relaunch)
        self._exposure_t: float | None = None

    # ----------------------------------------------------------------------------------------------- public
    def start(self, t: float) -> list[Action]:
        """The first actions: launch on every host, or wait if there are too few."""
        return self._relaunch(t)

    def step(self, ev: Event) -> list[Action]:
        """Takes one observation; returns the actions it calls for, in order."""
        if self.done is not None:
            return []
        self._accrue_exposure(ev.t)
        out: list[Action] = []
        if isinstance(ev, Beat):
            self._on_beat(ev, out)
        elif isinstance(ev, Exit):
            self._on_exit(ev, out)
        elif isinstance(ev, ProbeResult):
            self._on_probe(ev, out)
        elif isinstance(ev, Preempt):
            self._on_preempt(ev.t, out)
        self._on_tick(ev.t, out)
        return out

    def host_mtbf_estimate(self) -> float:
        """Host-seconds per group-stopping failure: the gamma-Poisson posterior mean with `host_mtbf_s` as a prior
        worth w = `host_mtbf_weight` failures, (w * host_mtbf_s + host-seconds seen) / (w + failures seen). 0 when
        host_mtbf_s is 0 (unknown)."""
        c = self.config
        if c.host_mtbf_s <= 0:
            return 0.0
        w = c.host_mtbf_weight
        return (w * c.host_mtbf_s + self.exposure_s) / (w + self.group_failures)

    def likely_sizes(self) -> list[int]:
        """Group sizes the next launches will probably have, most likely first: the size after one more host
        fails, and the size once every quarantined host is back. Empty while no group runs."""
        g = self.group
        if g is None:
            return []
        n = len(g.hosts)
        not_excluded = sum(hs.status != EXCLUDED for hs in self.hosts.values())
        out = [self._size_for(n - 1), self._size_for(not_excluded)]
        return [s for i, s in enumerate(out) if s and s != n and s not in out[:i]]

    def usable(self) -> list[str]:
        """Hosts that may join the next launch (healthy, or quarantined and probed ok), in host order."""
        return [h for h in self.order if self.hosts[h].status == HEALTHY or self.hosts[h].ready]

    # ----------------------------------------------------------------------------------------------- events
    def _accrue_exposure(self, t: float) -> None:
        g = self.group
        if g is not None and self._exposure_t is not None and g.mode != "killing":
            self.exposure_s += max(0.0, t - self._exposure_t) * len(g.hosts)
        self._exposure_t = t

    def _live_member(self, ev: Beat | Exit) -> Member | None:
        """The member `ev` is about, or None if it is stale: another attempt's, not a member's, or one that exited."""
        g = self.group
        if g is None or ev.attempt != g.attempt or ev.host not in g.members:
            return None
        m = g.members[ev.host]
        return None if m.exit_code is not None else m

    def _on_beat(self, ev: Beat, out: list[Action]) -> None:
        m = self._live_member(ev)
        if m is None:
            return
        g = self.group
        stale = ev.restarts < m.restarts  # sent before this worker restarted in-process: its start step is old
        m.seen_restarts = max(m.seen_restarts, ev.restarts)
        if m.first_beat_t is None:
            m.first_beat_t = ev.t
        m.last_beat_t = ev.t
        if ev.step != m.step or ev.phase != m.phase:
            m.progress_t = ev.t
        m.step, m.phase, m.where = ev.step, ev.phase, ev.where
        m.compile_s = max(m.compile_s, ev.compile_s)
        if ev.joined and m.joined_t is None:
            m.joined_t = ev.t
        if ev.start_step is not None and not stale:
            if m.start_step is None:
                m.compile_at_restore = m.compile_s
            m.start_step = ev.start_step
        if ev.phase == "train" and m.start_step is not None and ev.step > m.start_step and not stale:
            m.trained = True
            if g.rate_t0 is None:
                g.rate_t0 = (ev.t, ev.step)
        g.max_step = max(g.max_step, ev.step)
        self._advance_recovery(ev.t, out)

    def _on_exit(self, ev: Exit, out: list[Action]) -> None:
        m = self._live_member(ev)
        if m is None:
            return
        g = self.group
        m.exit_code, m.exit_t = ev.code, ev.t
        out.append(Record("exit", {"attempt": g.attempt, "host": ev.host, "code": ev.code, "step": m.step}))
        if ev.code != 0 and g.mode != "killing" and g.first_failed_exit_t is None:
            g.first_failed_exit_t = ev.t
        if not g.live():
            self._settle_exits(ev.t, out)

    def _on_probe(self, ev: ProbeResult, out: list[Action]) -> None:
        hs = self.hosts.get(ev.host)
        if hs is None or hs.status != QUARANTINED:
            return
        hs.probing = False
        hs.next_probe_t = ev.t + self.config.probe_interval
        hs.ready = ev.ok
        out.append(Record("probe", {"host": ev.host, "ok": ev.ok}))

    def _on_preempt(self, t: float, out: list[Action]) -> None:
        g = self.group
        again = self.preempted
        self.preempted = True
        out.append(Record("preempt", {"again": again}))
        if g is None:
            self._finish("preempted", "stop requested while waiting", out)
        elif again and g.mode != "killing":
            self._kill(t, "second stop request", out)
        elif g.mode == "running":
            g.mode, g.stop_reason, g.deadline = "stopping", "preempt", t + self.config.stop_timeout
            out.append(RequestStop(g.attempt, "preempt"))
        elif g.mode == "stopping":
            g.stop_reason = "preempt"

    # ------------------------------------------------------------------------------------------------ clock
    def _on_tick(self, t: float, out: list[Action]) -> None:
        if self.done is not None:
            return
        g = self.group
        if g is not None:
            self._check_group(t, out)
        self._probe_due(t, out)
        self._maybe_readmit(t, out)

    def _check_group(self, t: float, out: list[Action]) -> None:
        g, c = self.group, self.config
        if g.mode == "killing":
            if t >= g.deadline:
                left = [m.host for m in g.live()]
                out.append(Record("kill_timeout", {"attempt": g.attempt, "hosts": left}))
                self._group_down(t, out)
            return
        if g.first_failed_exit_t is not None:
            if t - g.first_failed_exit_t >= c.exit_window or not g.live():
                self._settle_exits(t, out)
            return
        if g.mode == "stopping" and t >= g.deadline:
            out.append(Record("stop_timeout", {"attempt": g.attempt, "reason": g.stop_reason}))
            self._kill(t, "clean stop timed out", out)
            return
        live = g.live()
        lost = []
        for m in live:
            if m.first_beat_t is None and t - m.launched_t > c.startup_timeout:
                lost.append((m, m.launched_t, "no heartbeat after launch"))
            elif m.last_beat_t is not None and t - m.last_beat_t > self._silence_allowed(m):
                lost.append((m, m.last_beat_t, "heartbeat lost"))
        if lost:
            self._fail(t, [m.host for m, _, _ in lost], lost[0][2], min(f for _, f, _ in lost), out)
            return
        stuck = [m for m in live if m.first_beat_t is not None and t - m.progress_t > self._grace(m)]
        if not stuck:
            return
        fault_t = min(m.progress_t for m in stuck)
        # Waiters on a hung host stop a moment after it: within the slack they count as stuck with it.
        together = [m for m in live if t - m.progress_t > self._grace(m) - min(c.hang_slack, self._grace(m) / 2)]
        if len(together) < len(live):
            self._fail(t, [m.host for m in stuck], "no progress", fault_t, out)
            return
        blamed = _blame_hang(live)
        if blamed:
            self._fail(t, blamed, "no progress (hung while the others waited)", fault_t, out)
        else:
            self._fail(t, [], "no progress on every host (culprit unknown)", fault_t, out)

    def _silence_allowed(self, m: Member) -> float:
        # A process that said it is exiting stops beating while JAX's shutdown waits for the others; its exit
        # (or the start-up grace) settles it, not the heartbeat.
        return self.config.startup_timeout if m.phase == EXITING else self.config.heartbeat_timeout

    def _grace(self, m: Member) -> float:
        return self.config.progress_timeout if m.phase == "train" else self.config.startup_timeout

    def _settle_exits(self, t: float, out: list[Action]) -> None:
        """All exits are in, or the window after the first failed one has passed: decide what they mean."""
        g = self.group
        if g.mode == "killing":
            self._group_down(t, out)
            return
        failed = [m for m in g.members.values() if m.exit_code not in (None, 0)]
        if failed:
            everyone = len(failed) == len(g.members)
            if everyone and not any(_died_by_signal(m.exit_code) for m in failed):
                # Every process raised: a software or configuration error, not a host's fault.
                self._fail(t, [], "every process exited with an error", min(m.exit_t for m in failed), out)
            else:
                first = min(m.exit_t for m in failed)
                blamed = [m for m in failed if m.exit_t == first]
                blamed = [m for m in blamed if _died_by_signal(m.exit_code)] or blamed
                # Exits seen in the same poll: a peer that aborted (SIGABRT: its collective or the coordination
                # service lost the dead process) is the cascade, not the cause, if another died by a signal of its own.
                blamed = [m for m in blamed if not _aborted(m.exit_code)] or blamed
                self._fail(t, [m.host for m in blamed], f"exit code {blamed[0].exit_code}", first, out)
            return
        if g.live():
            return
        # Every process exited 0.
        if g.mode == "stopping":
            out.append(Record("stopped", {"attempt": g.attempt, "reason": g.stop_reason, "step": g.max_step}))
            self._group_down(t, out)
        else:
            self.group = None
            self._finish("finished", "every process exited 0", out)

    # -------------------------------------------------------------------------------------------- decisions
    def _fail(self, t: float, hosts: list[str], reason: str, fault_t: float, out: list[Action]) -> None:
        """Hosts `hosts` failed (none: the group failed as a whole): strike them, kill the group."""
        g = self.group
        out.append(
            Record(
                "failure",
                {
                    "attempt": g.attempt,
                    "hosts": hosts,
                    "reason": reason,
                    "step": g.max_step,
                    "detection_s": round(t - fault_t, 3),
                },
            )
        )
        for h in hosts:
            hs = self.hosts[h]
            hs.strikes += 1
            hs.ready = hs.probing = False
            hs.next_probe_t = t + self.config.probe_interval
            hs.status = EXCLUDED if hs.strikes >= self.config.max_strikes else QUARANTINED
            kind = "exclude" if hs.status == EXCLUDED else "quarantine"
            out.append(Record(kind, {"host": h, "strikes": hs.strikes}))
        self.group_failures += 1
        if g.max_step > self.best_step:
            self.best_step, self.failures_without_progress = g.max_step, 0
        else:  # this group got no further than an earlier one: a crash that repeats
            self.failures_without_progress += 1
        if self.config.fenced and reason in LOST_REASONS:
            for h in hosts:
                m = g.members[h]
                if m.exit_code is None:
                    m.exit_code, m.exit_t = EXIT_FENCED, t
                    out.append(Record("fenced_off", {"attempt": g.attempt, "host": h}))
        if self._can_shrink(g, hosts, reason):
            self._shrink(t, hosts, fault_t, out)
            return
        if self.recovery is None:
            self.recovery = Recovery("failure", tuple(hosts), fault_t, t, g.max_step)
        else:  # failed again before the recovery finished: one longer recovery
            self.recovery.relaunches += 1
            self.recovery.last_step = max(self.recovery.last_step, g.max_step)
            if "failure" not in self.recovery.cause:
                self.recovery.cause += "+failure"
        self._kill(t, reason, out)

    def _can_shrink(self, g: Group, hosts: list[str], reason: str) -> bool:
        if not self.config.in_process or not hosts or g.mode != "running" or not reason.startswith("exit code"):
            return False
        rest = [h for h in g.hosts if h not in hosts]
        if g.hosts[0] in hosts or any(g.members[h].exit_code is not None for h in rest):
            return False  # the coordination service died with process 0, or the others did not survive
        if self.recovery is not None and self.recovery.attempt != g.attempt:
            return False  # a relaunch is still on its way
        return self._size_for(len(rest)) == len(rest)

    def _shrink(self, t: float, hosts: list[str], fault_t: float, out: list[Action]) -> None:
        """The survivors of the failed `hosts` go on in their processes: the group loses those members and
        is timed as a recovery until every survivor trained past the step it restarted from."""
        g = self.group
        g.hosts = tuple(h for h in g.hosts if h not in hosts)
        for h in hosts:
            del g.members[h]
        g.first_failed_exit_t = None
        ongoing = self.recovery is not None and self.recovery.cause == "in-process"
        for m in g.members.values():
            m.start_step, m.trained, m.compile_at_restore, m.progress_t = None, False, None, t
            if not ongoing:  # one restart of the worker may cover both failures of an ongoing recovery
                m.restarts = m.seen_restarts + 1
        r = Recovery("in-process", tuple(hosts), fault_t, t, g.max_step, attempt=g.attempt)
        r.down_t = r.launch_t = r.connected_t = r.joined_t = t
        if self.recovery is not None:  # a second failure while the first recovery ran
            r.relaunches, r.fault_t = self.recovery.relaunches + 1, self.recovery.fault_t
        self.recovery = r
        out.append(Record("shrink", {"attempt": g.attempt, "hosts": list(g.hosts), "lost": list(hosts)}))

    def _kill(self, t: float, reason: str, out: list[Action]) -> None:
        g = self.group
        g.mode, g.deadline = "killing", t + self.config.kill_timeout
        out.append(Kill(g.attempt, reason))
        if not g.live():
            self._group_down(t, out)

    def _group_down(self, t: float, out: list[Action]) -> None:
        """Every process of the group is gone: finish, or launch the next group."""
        if self.recovery is not None and self.recovery.down_t is None:
            self.recovery.down_t = t
            self.recovery.last_step = max(self.recovery.last_step, self.group.max_step)
        self.group = None
        if self.preempted:
            self._finish("preempted", "stopped on request; launch again to resume", out)
            return
        if self.failures_without_progress >= self.config.max_failures_without_progress:
            n = self.failures_without_progress
            self._finish("failed", f"{n} failures in a row got no further than step {self.best_step}", out)
            return
        out.extend(self._relaunch(t))

    def _relaunch(self, t: float) -> list[Action]:
        out: list[Action] = []
        alive = [h for h in self.order if self.hosts[h].status != EXCLUDED]
        if len(alive) < self.config.min_hosts:
            why = f"only {len(alive)} hosts not excluded, min_hosts={self.config.min_hosts}"
            self._finish("failed", why, out)
            return out
        usable = self.usable()
        size = self._size_for(len(usable))
        if size == 0 and not self.config.readmit:
            self._finish("failed", f"{len(usable)} usable hosts, min_hosts={self.config.min_hosts}", out)
            return out
        if size == 0:
            if self.waiting_since is None:
                self.waiting_since = t
                out.append(Record("waiting", {"usable": usable, "min_hosts": self.config.min_hosts}))
            return out
        self.waiting_since = None
        hosts = tuple(usable[:size])
        for h in hosts:
            hs = self.hosts[h]
            if hs.status == QUARANTINED:
                hs.status, hs.ready = HEALTHY, False
                out.append(Record("readmit", {"host": h, "strikes": hs.strikes}))
        attempt = self.next_attempt
        self.next_attempt += 1
        self.group = Group(attempt, hosts, t, {h: Member(h, t, progress_t=t) for h in hosts})
        if self.recovery is not None:  # timed from this launch on, also if an earlier one failed
            r = self.recovery
            r.attempt, r.launch_t, r.connected_t, r.restored_t, r.restored_step = attempt, t, None, None, None
            r.joined_t = None
        out.append(Record("launch", {"attempt": attempt, "hosts": list(hosts)}))
        out.append(Launch(attempt, hosts))
        return out

    def _size_for(self, n: int) -> int:
        """The largest allowed group size that `n` usable hosts can fill, or 0 if below the minimum."""
        sizes = self.config.group_sizes or range(1, n + 1)
        fits = [s for s in sizes if self.config.min_hosts <= s <= n]
        return max(fits, default=0)

    def _probe_due(self, t: float, out: list[Action]) -> None:
        if not self.config.readmit:
            return
        for h in self.order:
            hs = self.hosts[h]
            if hs.status == QUARANTINED and not hs.ready and not hs.probing and t >= hs.next_probe_t:
                hs.probing = True
                out.append(Probe(h))

    def _maybe_readmit(self, t: float, out: list[Action]) -> None:
        if not any(hs.ready for hs in self.hosts.values()):
            return
        g = self.group
        if g is None:
            if self.done is None:
                out.extend(self._relaunch(t))
            return
        if g.mode != "running" or not all(m.trained for m in g.members.values()):
            return  # do not stop a group that is still starting or already stopping
        new_size = self._size_for(len(self.usable()))
        if new_size <= len(g.hosts):
            return  # the repaired host would not make a bigger group: it waits as a spare
        c = self.config
        if c.total_steps and c.total_steps - g.max_step <= max(c.ckpt_every, 1):
            return  # the run ends before a stop would pay off
        if not self.readmit_pays(len(g.hosts), new_size):
            return  # cheaper to wait: the ready hosts join at the next failure-driven relaunch
        g.mode, g.stop_reason = "stopping", "readmit"
        g.deadline = t + c.stop_timeout + self._time_to_checkpoint(t, g)
        ready = [h for h in self.order if self.hosts[h].ready]
        self.recovery = Recovery("readmit", tuple(ready), t, t, g.max_step)
        out.append(RequestStop(g.attempt, "readmit"))
        out.append(Record("stop_request", {"attempt": g.attempt, "reason": "readmit", "hosts": ready}))

    def readmit_pays(self, size: int, new_size: int) -> bool:
        """Whether stopping a group of `size` hosts to relaunch it with `new_size` gains more host-seconds of
        training (the added hosts, until the next failure at the new size is expected) than the relaunch costs
        (every host of the new group idle for one relaunch). Always true when `host_mtbf_s` is unknown (0)."""
        mtbf = self.host_mtbf_estimate()
        if mtbf <= 0:
            return True
        c = self.config
        relaunch = sum(self.relaunch_s) / len(self.relaunch_s) if self.relaunch_s else c.relaunch_estimate_s
        return (new_size - size) * mtbf / new_size >= new_size * relaunch

    def _time_to_checkpoint(self, t: float, g: Group) -> float:
        """Seconds the group needs to reach its next checkpoint at its measured step rate (0 if unknown)."""
        if not self.config.ckpt_every or g.rate_t0 is None or t <= g.rate_t0[0] or g.max_step <= g.rate_t0[1]:
            return 0.0
        rate = (g.max_step - g.rate_t0[1]) / (t - g.rate_t0[0])
        left = self.config.ckpt_every - g.max_step % self.config.ckpt_every
        return left / rate

    def _advance_recovery(self, t: float, out: list[Action]) -> None:
        r, g = self.recovery, self.group
        if r is None or r.attempt != g.attempt:
            return
        ms = list(g.members.values())
        if r.connected_t is None and all(m.first_beat_t is not None for m in ms):
            r.connected_t = t
        if r.joined_t is None and all(m.joined_t is not None or m.start_step is not None for m in ms):
            r.joined_t = t
        if r.restored_t is None and all(m.start_step is not None for m in ms):
            r.restored_t, r.restored_step = t, min(m.start_step for m in ms)
        if r.restored_t is None or r.connected_t is None or not all(m.trained for m in ms):
            return
        joined_t = r.joined_t if r.joined_t is not None else r.connected_t
        down_t = r.down_t if r.down_t is not None else r.detect_t
        # Seconds each worker spent compiling (or loading executables) after its restore; the slowest counts.
        compile_s = max(m.compile_s - (m.compile_at_restore or 0.0) for m in ms)
        out.append(
            Record(
                "recovery",
                {
                    "cause": r.cause,
                    "hosts": list(r.hosts),
                    "attempt": g.attempt,
                    "group_size": len(g.hosts),
                    "relaunches": r.relaunches,
                    "detection_s": round(r.detect_t - r.fault_t, 3),
                    "restart_s": round(r.connected_t - r.detect_t, 3),  # stop_s of it to take the group down
                    "stop_s": round(r.down_t - r.detect_t, 3),
                    "restore_s": round(r.restored_t - r.connected_t, 3),
                    "first_step_s": round(t - r.restored_t, 3),
                    # The same time, split finer (they add up to total_s): fault -> decision -> old group gone ->
                    # every new process beats -> every one joined JAX -> restored -> compiled -> a step done.
                    "split": {
                        "detect": round(r.detect_t - r.fault_t, 3),
                        "kill": round(down_t - r.detect_t, 3),
                        "spawn": round(r.connected_t - down_t, 3),
                        "join": round(joined_t - r.connected_t, 3),
                        "restore": round(r.restored_t - joined_t, 3),
                        "compile": round(min(compile_s, t - r.restored_t), 3),
                        "first_step": round(max(0.0, t - r.restored_t - compile_s), 3),
                    },
                    "total_s": round(t - r.fault_t, 3),
                    "last_step": r.last_step,
                    "restored_step": r.restored_step,
                    "lost_steps": max(0, r.last_step - r.restored_step),
                },
            )
        )
        # The relaunch proper: old group gone -> new group's first step (a stop for re-admission trains until then).
        self.relaunch_s.append(t - (r.down_t if r.down_t is not None else r.detect_t))
        self.recovery = None

    def _finish(self, status: str, reason: str, out: list[Action]) -> None:
        self.done = Finish(status, reason)
        out.append(Record("finish", {"status": status, "reason": reason}))
        out.append(self.done)


def _died_by_signal(code: int | None) -> bool:
    """Exit codes of a process killed by a signal: negative from Popen, 128+n through a shell or ssh."""
    return code is not None and (code < 0 or code >= 128)


def _aborted(code: int | None) -> bool:
    """A process that aborted itself (SIGABRT, 6): what gloo and JAX's coordination service do to the survivors of a
    dead peer."""
    return code is not None and _died_by_signal(code) and (-code if code < 0 else code - 128) == signal.SIGABRT


def _blame_hang(members: list[Member]) -> list[str]:
    """Hosts to blame when the whole group stopped making progress together: the ones behind the others, or
    else the ones whose main thread is somewhere other than where most are (the others wait in a collective).
    Returns [] when nothing sets a host apart."""
    top = max(m.step for m in members)
    behind = [m.host for m in members if m.step < top]
    if behind:
        return behind
    counts = Counter(m.where for m in members)
    common, n = counts.most_common(1)[0]
    if not common or 2 * n <= len(members):
        return []
    return [m.host for m in members if m.where != common]

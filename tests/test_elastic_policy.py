"""The elastic policy on a fake clock: failures, quarantine, strikes, waiting, re-admission, preemption."""

import pytest

from reve_jax.elastic import policy as P

HOSTS = ["h0", "h1", "h2", "h3"]


class Run:
    """Drives a Policy the way the supervisor does, with a clock the test moves."""

    def __init__(self, hosts=HOSTS, **config):
        self.policy = P.Policy(hosts, P.PolicyConfig(**config))
        self.t = 0.0
        self.actions = self.policy.start(self.t)

    def feed(self, ev) -> list:
        out = self.policy.step(ev)
        self.actions += out
        return out

    def tick(self, dt: float) -> list:
        self.t += dt
        return self.feed(P.Tick(self.t))

    @property
    def group(self):
        return self.policy.group

    def beat_all(self, step: int, phase: str = "train", where: str = "x.py:1:wait", start: int | None = 0):
        for h in self.group.hosts:
            self.feed(P.Beat(self.t, self.group.attempt, h, step, phase, start, where))

    def train(self, steps: int, dt: float = 1.0, start: int = 0):
        """Every host of the group trains `steps` steps, one beat per step each `dt` s."""
        first = self.group.max_step if self.group.max_step >= 0 else start
        self.beat_all(first, "compiling", start=first)
        for s in range(first + 1, first + steps + 1):
            self.tick(dt)
            self.beat_all(s, start=first)

    def exit_all(self, code: int = 0, hosts=None):
        g = self.group
        for h in hosts or g.hosts:
            if g.members[h].exit_code is None:
                self.feed(P.Exit(self.t, g.attempt, h, code))

    def of(self, kind):
        return [a for a in self.actions if isinstance(a, kind)]

    def records(self, kind: str) -> list[dict]:
        return [a.data for a in self.actions if isinstance(a, P.Record) and a.kind == kind]


def test_finishes_when_every_process_exits_zero():
    r = Run()
    assert r.of(P.Launch) == [P.Launch(0, tuple(HOSTS))]
    r.train(5)
    r.exit_all(0)
    assert r.policy.done == P.Finish("finished", "every process exited 0")


def test_failed_exit_quarantines_and_relaunches_on_survivors():
    r = Run(exit_window=0.5, probe_interval=5.0)
    r.train(10)
    r.feed(P.Exit(r.t, 0, "h2", -9))
    assert not r.of(P.Kill), "exits are collected for exit_window before blaming"
    r.tick(0.6)
    assert r.of(P.Kill) == [P.Kill(0, "exit code -9")]
    assert r.policy.hosts["h2"].status == P.QUARANTINED
    r.exit_all(-9)  # the kill lands
    assert r.of(P.Launch)[-1] == P.Launch(1, ("h0", "h1", "h3"))
    # The new group restores step 8, then trains: the recovery is recorded with its split and the lost steps.
    r.tick(2.0)
    r.beat_all(-1, "starting", start=None)
    r.tick(3.0)
    r.beat_all(8, "compiling", start=8)
    r.tick(4.0)
    r.beat_all(9, start=8)
    (rec,) = r.records("recovery")
    assert rec["last_step"] == 10 and rec["restored_step"] == 8 and rec["lost_steps"] == 2
    assert rec["detection_s"] == pytest.approx(0.6)
    assert rec["restart_s"] == pytest.approx(2.0)
    assert rec["restore_s"] == pytest.approx(3.0)
    assert rec["first_step_s"] == pytest.approx(4.0)
    assert rec["total_s"] == pytest.approx(9.6)


def test_first_exit_is_blamed_not_the_cascade():
    r = Run()
    r.train(3)
    r.feed(P.Exit(r.t, 0, "h1", -9))
    r.t += 0.2  # peers abort after it within the window: the first one is the cause
    r.feed(P.Exit(r.t, 0, "h0", -6))
    r.tick(0.5)
    assert r.records("quarantine") == [{"host": "h1", "strikes": 1}]


@pytest.mark.parametrize("killed, aborted", [(-9, -6), (137, 134)])
def test_a_peer_that_aborts_in_the_same_poll_is_not_blamed(killed, aborted):
    """The supervisor can see the killed process and a peer that aborted on its loss in one poll (measured on the
    namespace bed: exit codes 137 and 134 through ssh, both at once): the abort is the cascade."""
    r = Run()
    r.train(3)
    r.feed(P.Exit(r.t, 0, "h2", aborted))
    r.feed(P.Exit(r.t, 0, "h1", killed))
    r.tick(0.5)
    assert r.records("quarantine") == [{"host": "h1", "strikes": 1}]
    alone = Run()  # an abort with no other cause in sight is the host's own
    alone.train(3)
    alone.feed(P.Exit(alone.t, 0, "h2", aborted))
    alone.tick(0.5)
    assert alone.records("quarantine") == [{"host": "h2", "strikes": 1}]


def test_every_process_raising_is_no_hosts_fault():
    r = Run()
    r.train(3)
    r.exit_all(1)
    assert r.records("failure")[0]["hosts"] == []
    assert all(h.status == P.HEALTHY for h in r.policy.hosts.values())
    assert r.of(P.Launch)[-1].hosts == tuple(HOSTS)


def test_lost_heartbeat_is_a_failure():
    r = Run(heartbeat_timeout=5.0)
    r.train(3)
    g = r.group
    for _ in range(6):  # h3 stops beating (SIGSTOP), the others go on beating at the same step
        r.tick(1.0)
        for h in ("h0", "h1", "h2"):
            r.feed(P.Beat(r.t, g.attempt, h, 3, "train", 0))
    (fail,) = r.records("failure")
    assert fail["hosts"] == ["h3"] and fail["reason"] == "heartbeat lost"
    assert fail["detection_s"] == pytest.approx(6.0)


def test_no_first_beat_within_startup_timeout():
    r = Run(startup_timeout=30.0, heartbeat_timeout=5.0)
    for _ in range(31):
        r.tick(1.0)
        for h in ("h0", "h1", "h2"):
            r.feed(P.Beat(r.t, 0, h, -1, "starting"))
    assert r.records("failure")[0]["hosts"] == ["h3"]


def test_hang_blames_the_host_whose_main_thread_is_elsewhere():
    r = Run(progress_timeout=10.0)
    r.train(5)
    g = r.group
    for _ in range(11):  # beats go on, the step does not: three wait in the collective, h1 is stuck elsewhere
        r.tick(1.0)
        for h in g.hosts:
            where = "data.py:40:read" if h == "h1" else "array.py:9:block_until_ready"
            r.feed(P.Beat(r.t, g.attempt, h, 5, "train", 0, where))
    (fail,) = r.records("failure")
    assert fail["hosts"] == ["h1"]


def test_hang_blames_the_host_behind():
    r = Run(progress_timeout=10.0)
    r.train(5)
    g = r.group
    for _ in range(11):
        r.tick(1.0)
        for h in g.hosts:
            r.feed(P.Beat(r.t, g.attempt, h, 4 if h == "h2" else 5, "train", 0, "x.py:1:f"))
    assert r.records("failure")[0]["hosts"] == ["h2"]


def test_hang_with_no_culprit_restarts_everyone():
    r = Run(progress_timeout=10.0)
    r.train(5)
    for _ in range(11):
        r.tick(1.0)
        r.beat_all(5)
    assert r.records("failure")[0]["hosts"] == []
    r.exit_all(-9)
    assert r.of(P.Launch)[-1].hosts == tuple(HOSTS)


def _until_failure(r: Run, phase: str, seconds: int) -> dict | None:
    """Every host beats step 0 in `phase` once a second for up to `seconds` s; returns the first failure."""
    for _ in range(seconds):
        r.tick(1.0)
        if r.records("failure"):
            return r.records("failure")[0]
        r.beat_all(0, phase, start=0)
    return None


def test_compiling_gets_the_startup_grace():
    """Compiling is not hanging: 50 s at step 0 in phase "compiling" is no failure under a 10 s progress_timeout,
    for compiling gets the start-up grace (100 s). The grace is bounded: the same beats going on past it are a
    failure, and the same 50 s in phase "train" are one after progress_timeout (so a policy that never detects a
    stuck group, or gives "train" the start-up grace, fails here)."""
    r = Run(progress_timeout=10.0, startup_timeout=100.0)
    assert _until_failure(r, "compiling", 50) is None
    fail = _until_failure(r, "compiling", 60)  # the first beat came at t=1: stuck since then
    assert fail is not None, "still compiling at step 0 past the start-up grace: not detected"
    assert fail["hosts"] == [] and fail["reason"].startswith("no progress"), fail
    assert 100.0 <= fail["detection_s"] <= 102.0 and r.t <= 103.0, (fail, r.t)
    assert r.of(P.Kill)

    r = Run(progress_timeout=10.0, startup_timeout=100.0)
    fail = _until_failure(r, "train", 50)
    assert fail is not None, "training at step 0 past progress_timeout: not detected"
    assert fail["hosts"] == [] and fail["reason"].startswith("no progress"), fail
    assert 10.0 <= fail["detection_s"] <= 12.0 and r.t <= 13.0, (fail, r.t)


def test_strikes_exclude_a_host_for_good():
    r = Run(max_strikes=2, probe_interval=1.0)
    for round_ in range(2):
        r.train(2)
        r.feed(P.Exit(r.t, r.group.attempt, "h0", -9))
        r.tick(1.0)
        r.exit_all(-9)
        if round_ == 0:  # the probe passes: back in, once the running group has trained (it is then stopped)
            assert [a for a in r.tick(1.0) if isinstance(a, P.Probe)] == [P.Probe("h0")]
            r.feed(P.ProbeResult(r.t, "h0", True))
            assert "h0" not in r.group.hosts and not r.of(P.RequestStop)
            r.train(2)
            assert r.of(P.RequestStop)[-1].reason == "readmit"
            r.exit_all(0)
            assert r.of(P.Launch)[-1].hosts == tuple(HOSTS)
    assert r.policy.hosts["h0"].status == P.EXCLUDED
    assert r.records("exclude") == [{"host": "h0", "strikes": 2}]
    for _ in range(30):
        assert not [a for a in r.tick(1.0) if isinstance(a, P.Probe)]


def test_below_min_hosts_waits_probing_then_trains():
    r = Run(min_hosts=4, probe_interval=2.0)
    r.train(3)
    r.feed(P.Exit(r.t, 0, "h3", -9))
    r.tick(1.0)
    r.exit_all(-9)
    assert r.group is None and r.records("waiting")
    assert len(r.of(P.Launch)) == 1
    probes = [a for _ in range(3) for a in r.tick(1.0) if isinstance(a, P.Probe)]
    assert probes == [P.Probe("h3")]
    r.feed(P.ProbeResult(r.t, "h3", False))
    assert r.group is None
    probes = [a for _ in range(3) for a in r.tick(1.0) if isinstance(a, P.Probe)]
    r.feed(P.ProbeResult(r.t, "h3", True))
    assert r.of(P.Launch)[-1] == P.Launch(1, tuple(HOSTS))
    assert r.records("readmit") == [{"host": "h3", "strikes": 1}]


def test_readmit_stops_at_next_checkpoint_and_relaunches_with_host():
    r = Run(probe_interval=2.0, ckpt_every=10, stop_timeout=30.0)
    r.train(4)
    r.feed(P.Exit(r.t, 0, "h2", 1))
    r.tick(1.0)
    r.exit_all(-9)
    r.train(3, start=0)  # on three hosts; the probe is due meanwhile
    assert r.of(P.Probe) == [P.Probe("h2")] and not r.of(P.RequestStop)
    r.feed(P.ProbeResult(r.t, "h2", True))
    assert r.of(P.RequestStop) == [P.RequestStop(1, "readmit")]
    # The stop deadline allows for reaching the next checkpoint at the measured rate (1 step/s, 7 steps left).
    assert r.group.deadline == pytest.approx(r.t + 30.0 + 7.0)
    r.train(2)
    r.exit_all(0)
    assert r.of(P.Launch)[-1] == P.Launch(2, tuple(HOSTS))
    r.train(1, start=5)  # the stop saved step 5
    (_, readmit) = r.records("recovery")
    assert readmit["cause"] == "readmit" and readmit["lost_steps"] == 0


def test_readmit_skipped_when_group_size_would_not_grow():
    r = Run(group_sizes=(2, 4), probe_interval=1.0)
    assert r.of(P.Launch)[-1].hosts == tuple(HOSTS)
    r.train(2)
    r.feed(P.Exit(r.t, 0, "h1", -9))
    r.tick(1.0)
    r.exit_all(-9)
    assert r.of(P.Launch)[-1].hosts == ("h0", "h2"), "three hosts left, the largest allowed group is 2"
    r.train(2)
    r.feed(P.Exit(r.t, 1, "h2", -9))
    r.tick(1.0)
    r.exit_all(-9)
    assert r.of(P.Launch)[-1].hosts == ("h0", "h3")


def test_stop_timeout_kills_without_blame():
    r = Run(stop_timeout=5.0)
    r.train(2)
    r.feed(P.Preempt(r.t))
    assert r.of(P.RequestStop) == [P.RequestStop(0, "preempt")]
    for _ in range(6):
        r.tick(1.0)
    assert r.of(P.Kill)
    r.exit_all(-9)
    assert r.policy.done.status == "preempted"
    assert all(h.status == P.HEALTHY for h in r.policy.hosts.values())


def test_preempt_clean_stop_then_second_signal_kills():
    r = Run()
    r.train(2)
    r.feed(P.Preempt(r.t))
    r.feed(P.Preempt(r.t))
    assert r.of(P.Kill) == [P.Kill(0, "second stop request")]
    r.exit_all(-9)
    assert r.policy.done.status == "preempted"


def test_preempt_clean():
    r = Run()
    r.train(2)
    r.feed(P.Preempt(r.t))
    r.exit_all(0)
    assert r.policy.done.status == "preempted"
    assert r.records("stopped")[0]["reason"] == "preempt"


def test_gives_up_on_a_crash_that_repeats():
    r = Run(max_failures_without_progress=3, max_strikes=100)
    while not r.policy.done:
        r.train(2, start=0)
        r.exit_all(1)
    assert r.policy.done.status == "failed"
    # The first failure sets the best step; three more that get no further give up.
    assert len(r.records("failure")) == 4


def test_beats_of_an_old_group_are_ignored():
    r = Run(heartbeat_timeout=3.0)
    r.train(2)
    r.feed(P.Exit(r.t, 0, "h0", -9))
    r.tick(1.0)
    r.exit_all(-9)
    r.feed(P.Beat(r.t, 0, "h1", 50, "train", 0))
    assert r.group.attempt == 1 and r.group.max_step == -1


@pytest.mark.parametrize("host_mtbf_s, stops", [(1e9, True), (8.0, False)])
def test_readmit_by_cost_waits_for_the_next_relaunch_when_a_stop_does_not_pay(host_mtbf_s, stops):
    """With host_mtbf_s known, a repaired host stops the group only if 1 more host x (mtbf / 4 hosts) of training
    beats 4 hosts idle for a relaunch (measured: ~3 s here). Rarely failing hosts: stop at once; often failing
    ones: the ready host waits and joins when the next failure relaunches the group anyway."""
    # A fixed MTBF (a prior worth 1e12 failures): the rule alone, without learning from the failure below.
    r = Run(probe_interval=2.0, ckpt_every=10, host_mtbf_s=host_mtbf_s, host_mtbf_weight=1e12, relaunch_estimate_s=1e6)
    r.train(4)
    r.feed(P.Exit(r.t, 0, "h2", 1))
    r.tick(1.0)
    r.exit_all(-9)
    r.train(3, start=0)
    relaunch = r.policy.relaunch_s
    assert len(relaunch) == 1 and 1 <= relaunch[0] < 10  # measured, so the 1e6 s estimate no longer counts
    r.feed(P.ProbeResult(r.t, "h2", True))
    assert bool(r.of(P.RequestStop)) == stops
    assert r.policy.readmit_pays(3, 4) == stops
    if not stops:
        r.train(2)
        r.feed(P.Exit(r.t, 1, "h0", 1))  # the next failure: h2 joins the relaunch that follows
        r.tick(1.0)
        r.exit_all(-9)
        assert r.of(P.Launch)[-1].hosts == ("h1", "h2", "h3")
        assert r.records("readmit") == [{"host": "h2", "strikes": 1}]


def test_readmit_by_cost_decision_scales_with_cluster_size():
    # Llama-3-like hosts (MTBF ~264 days), a 7-minute relaunch: one repaired host pays on 16 hosts, not on 1,250,
    # where it takes ~29 ready hosts (N^2 x relaunch / MTBF) to pay for stopping everyone.
    config = P.PolicyConfig(host_mtbf_s=264 * 86_400.0, relaunch_estimate_s=420.0)
    pol = P.Policy([f"h{i}" for i in range(4)], config)
    assert pol.readmit_pays(15, 16)
    assert not pol.readmit_pays(1249, 1250)
    assert not pol.readmit_pays(1222, 1250) and pol.readmit_pays(1220, 1250)
    assert P.Policy(["a", "b"], P.PolicyConfig()).readmit_pays(1249, 1250)  # unknown MTBF: always


@pytest.mark.parametrize("weight", [1.0, 1e12])
def test_mtbf_estimate_learns_from_the_runs_own_failures(weight):
    """The cost rule's MTBF starts at host_mtbf_s and moves to host-seconds per failure as the run sees them
    (prior worth `weight` failures): an optimistic guess stops paying for a stop once hosts are seen failing."""
    r = Run(probe_interval=2.0, ckpt_every=10, host_mtbf_s=400.0, host_mtbf_weight=weight, relaunch_estimate_s=1.0)
    assert r.policy.host_mtbf_estimate() == 400.0
    r.train(4)  # t = 4: 4 hosts x 4 s
    r.feed(P.Exit(r.t, 0, "h2", 1))
    r.tick(1.0)  # blamed at t = 5, after the exit window: 4 hosts x 5 s in the failed group
    r.exit_all(-9)
    r.train(3, start=0)  # 3 hosts x 3 s in the new one
    assert r.policy.exposure_s == pytest.approx(4 * 5 + 3 * 3) and r.policy.group_failures == 1
    assert r.policy.host_mtbf_estimate() == pytest.approx((weight * 400.0 + 29.0) / (weight + 1))
    assert r.policy.relaunch_s == [pytest.approx(1.0)]
    # 16 hosts: one more host for mtbf/16 s pays for 16 hosts idle 1 s when mtbf >= 256 s: the fixed guess (400 s)
    # says yes, the learned estimate ((400 + 29) / 2 = 214.5 s) says no.
    assert r.policy.readmit_pays(15, 16) == (weight > 1)


def test_exiting_worker_may_fall_silent_and_a_lost_one_is_fenced_not_waited_for():
    """A worker whose last beat said "exiting" (JAX's shutdown waits for the others) is not lost by heartbeat;
    with fencing on, a host lost by heartbeat is not waited for once its group is killed."""
    r = Run(heartbeat_timeout=2.0, startup_timeout=30.0)
    r.train(3)
    for h in r.group.hosts:
        r.feed(P.Beat(r.t, 0, h, 3, "exiting", 0, ""))
    r.tick(5.0)
    assert not r.records("failure")
    r.exit_all(0)
    assert r.policy.done == P.Finish("finished", "every process exited 0")

    r = Run(heartbeat_timeout=2.0, fenced=True, kill_timeout=15.0)
    r.train(3)
    for _ in range(6):  # h2 falls silent (cut off), the others beat on
        r.t += 0.5
        for h in ("h0", "h1", "h3"):
            r.feed(P.Beat(r.t, 0, h, 3, "train", 0, ""))
    assert r.records("failure")[0]["hosts"] == ["h2"] and r.records("fenced_off") == [{"attempt": 0, "host": "h2"}]
    r.exit_all(-9, hosts=["h0", "h1", "h3"])  # the kill reaches the others; h2's process is never seen to exit
    assert r.of(P.Launch)[-1] == P.Launch(1, ("h0", "h1", "h3"))
    assert r.policy.likely_sizes() == [2, 4]  # one host fewer, or all four once h2 is back


def test_in_process_recovery_keeps_the_survivors_of_an_exit_and_relaunches_otherwise():
    """An exited host (not the coordinator's) shrinks the group in place; the recovery is timed from the
    survivors' new start step. A lost host, or the coordinator's, still relaunches."""
    r = Run(exit_window=0.5, in_process=True, heartbeat_timeout=5.0)
    r.train(10)
    r.feed(P.Exit(r.t, 0, "h2", -9))
    r.tick(0.6)
    assert not r.of(P.Kill) and len(r.of(P.Launch)) == 1
    assert r.records("shrink") == [{"attempt": 0, "hosts": ["h0", "h1", "h3"], "lost": ["h2"]}]
    assert r.group.hosts == ("h0", "h1", "h3") and r.records("quarantine")[0]["host"] == "h2"
    r.beat_all(10, start=0)  # in the collective still: their old start step must not end the recovery
    r.tick(3.0)  # the survivors' collective times out, they agree on the live devices and redo step 11
    for h in r.group.hosts:
        r.feed(P.Beat(r.t, 0, h, 10, "compiling", 10, restarts=1))
    r.tick(1.0)
    for h in r.group.hosts:
        r.feed(P.Beat(r.t, 0, h, 11, "train", 10, restarts=1))
    (rec,) = r.records("recovery")
    assert rec["cause"] == "in-process" and rec["group_size"] == 3 and rec["lost_steps"] == 0
    assert rec["total_s"] == pytest.approx(4.6) and rec["attempt"] == 0  # from the exit
    r.train(5)
    for _ in range(3):  # h3 goes silent: lost, not exited -> relaunch as before
        r.tick(2.0)
        for h in ("h0", "h1"):
            r.feed(P.Beat(r.t, 0, h, 16, "train", 10, restarts=1))
    assert r.of(P.Kill) and r.records("failure")[-1]["hosts"] == ["h3"]
    r2 = Run(exit_window=0.5, in_process=True)
    r2.train(5)
    r2.feed(P.Exit(r2.t, 0, "h0", -9))  # the coordinator's host: every process aborts
    r2.tick(0.6)
    assert r2.of(P.Kill) and not r2.records("shrink")

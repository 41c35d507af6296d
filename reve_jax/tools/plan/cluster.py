"""The simulated cluster: its parameters, and the failure trace one seed draws from them.

Every time is in seconds. Defaults are calibrated on published figures (docs/planning.md): the failure rate is
Llama 3's (419 unexpected interruptions in 54 days on 16,384 H100s), the costs are chosen so that Llama 3's
setting (restart-all with spares) gives its reported "over 90% effective training time".

The trace is drawn per host from its own random stream, before and independently of any policy, so two policies
(or two checkpoint intervals) run against exactly the same failures.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from reve_jax.elastic.policy import PolicyConfig

# Llama 3 405B pre-training (Llama 3 paper, section 3.3.4): 419 unexpected interruptions in a 54-day snapshot on
# 16,384 H100s.
LLAMA3_FAILURES_PER_GPU_DAY = 419 / (16_384 * 54)

CRASH, LOST, HANG, SLOW = "crash", "lost", "hang", "slow"
KINDS = (CRASH, LOST, HANG, SLOW)
POLICIES = ("isolate", "restart-all")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """One simulated run: the cluster, its failures, the job's costs and the supervisor's timeouts."""

    # --- cluster and horizon
    hosts: int = 1250  # hosts the job trains on at full size
    gpus_per_host: int = 8
    spares: int = 0  # extra hosts allocated to the job, idle until needed
    days: float = 30.0
    seed: int = 0
    # --- failures (a Poisson process per host while it is up)
    failures_per_gpu_day: float = LLAMA3_FAILURES_PER_GPU_DAY
    # Shares of the failure kinds: crash (the process exits with an error: Xid, ECC, a software bug), lost (the
    # host vanishes: no exit, no heartbeat), hang (alive, no progress: NCCL / network), slow (a straggler).
    mix: tuple[float, float, float, float] = (0.80, 0.05, 0.10, 0.05)
    repair_median_h: float = 3.0  # lognormal time until a failed host passes its probe again
    repair_sigma: float = 1.0  # of log(repair time); sigma 1 puts the mean at 1.65x the median
    slow_factor: float = 2.0  # a straggler makes every step take this many times as long
    slow_drain_s: float = 1800.0  # an outside monitor drains a straggler after this long (the policy cannot)
    # --- the job
    step_s: float = 5.0  # one step at full size; with n hosts a step takes step_s * hosts / n (fixed global batch)
    ckpt_interval_s: float = 600.0  # compute time between checkpoints at full size (rounded to whole steps)
    ckpt_save_s: float = 10.0  # training time a periodic save blocks (the rest of an async save overlaps)
    stop_save_s: float = 60.0  # a clean stop's synchronous save
    spawn_s: float = 30.0  # launch -> first heartbeat of each process
    restart_s: float = 180.0  # launch -> every process connected (scheduling, start-up, jax.distributed)
    restore_s: float = 60.0  # reading the checkpoint
    first_step_s: float = 120.0  # compile (from the persistent cache) and the first step
    kill_s: float = 30.0  # a killed group is gone (also the policy's kill_timeout)
    probe_s: float = 60.0  # one health probe of a quarantined host
    # --- in-memory snapshots (reve_jax/elastic/snapshot.py): each host's pieces also on its ring successor
    snapshot_interval_s: float = 0.0  # compute time between snapshots at full size (rounded to whole steps; 0: off)
    snapshot_save_s: float = 0.0  # training time one snapshot blocks (the main thread's share; the rest overlaps)
    snapshot_restore_s: float = 60.0  # restoring from the surviving copies in host memory instead of the disk
    # --- in-process recovery (reve_jax/elastic/inprocess.py): survivors of an exited host keep their processes
    in_process: bool = False
    collective_timeout_s: float = 30.0  # a collective with a dead peer fails after this (the in-process detection)
    # --- supervisor policy (reve_jax.elastic.policy.PolicyConfig, at cluster scale)
    heartbeat_timeout: float = 30.0
    progress_timeout: float = 300.0
    startup_timeout: float = 1800.0
    exit_window: float = 5.0
    stop_timeout: float = 600.0
    probe_interval: float = 300.0
    min_hosts_frac: float = 0.9  # isolate-and-continue trains on no fewer than this share of `hosts`
    group_multiple: int = 1  # allowed group sizes are multiples of this (e.g. so the global batch divides)
    max_strikes: int = 3
    # "cost": re-admit a repaired host only when it pays (PolicyConfig.host_mtbf_s from the failure rate above);
    # "always": stop the group as soon as a repaired host would make it bigger.
    readmit_rule: str = "cost"
    mtbf_guess: float = 1.0  # the MTBF the policy is told, as a multiple of the true one (a user's wrong guess)
    mtbf_weight: float = 1.0  # PolicyConfig.host_mtbf_weight: the guess counts as this many failures (1e12: fixed)

    @property
    def horizon_s(self) -> float:
        return self.days * 86_400.0

    @property
    def total_hosts(self) -> int:
        return self.hosts + self.spares

    @property
    def ckpt_every(self) -> int:
        """The checkpoint cadence in steps."""
        return max(1, round(self.ckpt_interval_s / self.step_s))

    @property
    def snapshot_every(self) -> int:
        """The snapshot cadence in steps (0: no snapshots)."""
        return max(1, round(self.snapshot_interval_s / self.step_s)) if self.snapshot_interval_s > 0 else 0

    def job_mtbf_s(self) -> float:
        """Mean time between failures of the hosts the job trains on (the M of Young's formula)."""
        per_s = self.failures_per_gpu_day * self.hosts * self.gpus_per_host / 86_400.0
        return math.inf if per_s <= 0 else 1.0 / per_s


def policy_config(c: ClusterConfig, policy: str) -> PolicyConfig:
    """The supervisor's PolicyConfig for `policy`: "isolate" (quarantine a failed host, continue on the rest,
    re-admit it once its probe passes) or "restart-all" (every launch needs `hosts` hosts: the job waits for a
    repaired host or takes a spare)."""
    common = dict(
        heartbeat_timeout=c.heartbeat_timeout,
        startup_timeout=c.startup_timeout,
        progress_timeout=c.progress_timeout,
        exit_window=c.exit_window,
        stop_timeout=c.stop_timeout,
        kill_timeout=c.kill_s,
        probe_interval=c.probe_interval,
        ckpt_every=c.ckpt_every,
        # The simulated run is open-ended, and a crash loop is not modelled: never give up on progress.
        max_failures_without_progress=10**9,
        in_process=c.in_process,
    )
    if c.readmit_rule not in ("cost", "always"):
        raise ValueError(f"readmit_rule {c.readmit_rule!r} is not 'cost' or 'always'")
    if c.readmit_rule == "cost" and c.failures_per_gpu_day > 0:
        common["host_mtbf_s"] = c.mtbf_guess * 86_400.0 / (c.failures_per_gpu_day * c.gpus_per_host)
        common["host_mtbf_weight"] = c.mtbf_weight
        common["relaunch_estimate_s"] = c.stop_save_s + c.restart_s + c.restore_s + c.first_step_s
    if policy == "restart-all":
        return PolicyConfig(min_hosts=c.hosts, group_sizes=(c.hosts,), max_strikes=10**9, **common)
    if policy != "isolate":
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    lo = max(1, math.ceil(c.min_hosts_frac * c.hosts))
    sizes: tuple[int, ...] = ()
    if c.spares or c.group_multiple > 1:  # cap at the job's size, and keep to the allowed multiples
        sizes = tuple(s for s in range(lo, c.hosts + 1) if s % c.group_multiple == 0)
    return PolicyConfig(min_hosts=lo, group_sizes=sizes, max_strikes=c.max_strikes, **common)


@dataclasses.dataclass(frozen=True)
class Fault:
    host: int
    t: float  # when it strikes
    kind: str
    degraded_until: float  # a straggler runs slow until here, then is drained (== t for other kinds)
    up_t: float  # repaired: usable again from here


class Trace:
    """The faults of every host over the horizon, sorted by time; answers what state a host is in."""

    def __init__(self, by_host: list[list[Fault]], horizon_s: float):
        self.by_host = by_host
        self.horizon_s = horizon_s
        self._times = [[f.t for f in fs] for fs in by_host]
        self.faults = sorted((f for fs in by_host for f in fs), key=lambda f: (f.t, f.host))

    def state(self, host: int, t: float) -> str:
        """ "up", "slow" (a straggler, still running) or "down" at time t."""
        i = bisect.bisect_right(self._times[host], t) - 1
        if i < 0:
            return "up"
        f = self.by_host[host][i]
        if t < f.degraded_until:
            return "slow"
        return "down" if t < f.up_t else "up"

    def next_passing_probe(self, host: int, start: float, probe_s: float, interval: float) -> float | None:
        """The end of the first probe that passes, for probes repeated every probe_s + interval from `start`
        (each fails while the host is down). None if none passes within the horizon."""
        t = start
        while t < self.horizon_s:
            if self.state(host, t) != "down" and self.state(host, t + probe_s) != "down":
                return t + probe_s
            t += probe_s + interval
        return None

    def down_stats(self) -> tuple[int, float]:
        """(most hosts down at once, time-averaged hosts down) over the horizon; stragglers count as up."""
        edges = []
        for f in self.faults:
            lo, hi = f.degraded_until, min(f.up_t, self.horizon_s)
            if hi > lo:
                edges += [(lo, 1), (hi, -1)]
        edges.sort()
        now = peak = 0
        area, last = 0.0, 0.0
        for t, d in edges:
            area += now * (t - last)
            now, last = now + d, t
            peak = max(peak, now)
        return peak, area / self.horizon_s


def draw_trace(c: ClusterConfig) -> Trace:
    """The failure trace of seed `c.seed`: per host, faults at Poisson times while it is up, each with a kind
    drawn from `c.mix` and a lognormal repair time. Host i's stream depends only on (seed, i)."""
    rate = c.failures_per_gpu_day * c.gpus_per_host / 86_400.0
    mix = np.asarray(c.mix, dtype=float)
    if mix.shape != (len(KINDS),) or (mix < 0).any() or mix.sum() <= 0:
        raise ValueError(f"mix must be {len(KINDS)} non-negative shares of {KINDS}, got {c.mix}")
    mix = mix / mix.sum()
    by_host: list[list[Fault]] = []
    for h in range(c.total_hosts):
        faults: list[Fault] = []
        if rate > 0:
            rng = np.random.default_rng([c.seed, h])
            t = 0.0
            while True:
                t += rng.exponential(1.0 / rate)
                if t >= c.horizon_s:
                    break
                kind = KINDS[int(rng.choice(len(KINDS), p=mix))]
                repair = 3600.0 * c.repair_median_h * math.exp(c.repair_sigma * rng.standard_normal())
                degraded = t + (c.slow_drain_s if kind == SLOW else 0.0)
                faults.append(Fault(h, t, kind, degraded, degraded + repair))
                t = degraded + repair
        by_host.append(faults)
    return Trace(by_host, c.horizon_s)


# Settings of published runs, for calibration (docs/planning.md), with the policy they ran.
PRESETS = {
    # Llama 3 405B: 16,384 H100s for 54 days; a failed host is replaced and the whole job restarts.
    "llama3": (dict(hosts=2048, spares=32, days=54.0), "restart-all"),
}


# The recovery mechanisms of docs/elastic.md at cluster scale, as ClusterConfig fields. The CPU test bed cannot
# time a 10,000-GPU relaunch; what it measures is how much each mechanism shortens its part of a recovery or costs
# a step, so the calibrated costs above are scaled by those before/after ratios (docs/planning.md).
RECOVERY_MECHANISMS = {
    # Warm standbys, compile-ahead and one executable per group (the netns bed, real trainer, SIGKILL, medians of
    # 3, docs/elastic.md): spawn 0.96 -> 0.11 s, spawn + join 3.73 -> 0.18 s, restore (build + read) 5.07 ->
    # 1.51 s, compile + first step 22.32 -> 4.03 s.
    "fast_restart": dict(spawn_s=30.0 * 0.11 / 0.96, restart_s=180.0 * 0.18 / 3.73, restore_s=60.0 * 1.51 / 5.07,
                         first_step_s=120.0 * 4.03 / 22.32),
    # In-memory snapshots, each host's pieces also on its ring successor (elastic/snapshot.py). One snapshot took
    # 3.9% of a step's CPU on the bed (scripts/bench_snapshot.py: main thread + snapshot thread + receiving the
    # predecessor's), counted here as if it all blocked the step; every 10 steps. A single host's failure then
    # costs the steps since the last snapshot, so the disk checkpoint is only the fallback (two ring neighbours
    # lost together) and is saved hourly.
    "snapshots": dict(snapshot_interval_s=50.0, snapshot_save_s=0.039 * 5.0, ckpt_interval_s=3600.0),
}  # fmt: skip
# Restore from the peers' copies / restore from the disk checkpoint: 0.26 s against 0.76 s on the bed (the real
# trainer after a kill, 4 -> 3 local hosts, from the log before the restore to the restored step; medians of 2).
SNAPSHOT_RESTORE_RATIO = 0.26 / 0.76
# In-process recovery (the fake worker on local processes, 3 hosts, SIGKILL): training again 5.2 s after the
# kill with a 5 s collective timeout, against 3.3 s for a relaunch of the same job; at cluster scale it saves the
# relaunch (restart_s) but waits for the collective timeout, and is taken for exits of hosts other than process
# 0's only (a lost or hung host, or the coordinator's, relaunches).
RECOVERY_MECHANISMS["in_process"] = dict(in_process=True)


def with_mechanisms(c: ClusterConfig, names) -> ClusterConfig:
    """`c` with the RECOVERY_MECHANISMS `names` applied; a restore from snapshots takes SNAPSHOT_RESTORE_RATIO of
    the (possibly shortened) restore from disk."""
    fields: dict = {}
    for name in names:
        if name not in RECOVERY_MECHANISMS:
            raise ValueError(f"unknown mechanism {name!r}; known: {sorted(RECOVERY_MECHANISMS)}")
        fields.update(RECOVERY_MECHANISMS[name])
    out = dataclasses.replace(c, **fields)
    if "snapshots" in names:
        out = dataclasses.replace(out, snapshot_restore_s=out.restore_s * SNAPSHOT_RESTORE_RATIO)
    return out


def add_arguments(parser) -> None:
    """Adds one --option per ClusterConfig field (e.g. --failures-per-gpu-day, --ckpt-interval-s) to an
    argparse parser, defaulting to None so that `config_from_args` can tell what was given."""
    for f in dataclasses.fields(ClusterConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "mix":
            parser.add_argument(flag, type=float, nargs=4, metavar=("CRASH", "LOST", "HANG", "SLOW"), help="shares")
        else:
            parser.add_argument(flag, type=type(f.default), default=None, help=f"default {f.default}")


def config_from_args(args, base: ClusterConfig | None = None) -> ClusterConfig:
    """The ClusterConfig of `base` (default: the defaults) with every field the parsed `args` set."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterConfig)}
    given = {k: tuple(v) if k == "mix" else v for k, v in given.items() if v is not None}
    return dataclasses.replace(base or ClusterConfig(), **given)

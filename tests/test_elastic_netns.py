"""The elastic launcher over real SSH on a multi-host bed: hosts are network namespaces this test creates, on a
private bridge, each running its own sshd (reve_jax/elastic/testbed.py). Faults: a worker SIGKILLed, one frozen
(SIGSTOP), a host's link cut (partition) while its worker keeps writing, sshd down so the re-admission probe
fails and later passes. Skipped where namespaces cannot be made (not root, no iproute2 or sshd). The bed is
removed at the end, also when a test fails."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_elastic_e2e import FAKE, FAKE_STEP, FAST, events, fake_w, last_metric_step, metrics_by_step, wait_until
from util import xla_flags

from reve_jax.elastic.testbed import NetnsBed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(bool(NetnsBed.unavailable()), reason=NetnsBed.unavailable() or "available")


@pytest.fixture
def bed(tmp_path):
    with NetnsBed(3, str(tmp_path / "bed")) as b:
        yield b


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def ssh_args(bed: NetnsBed, *extra: str) -> list[str]:
    return [
        "--remote-dir", ROOT, "--python", sys.executable, *[f"--ssh-arg={a}" for a in bed.ssh[1:]],
        "--devices-per-host", "2", *FAST, FAKE_STEP, *extra,
    ]  # fmt: skip


def worker_pid(workdir: str, host: str) -> int:
    """The pid (on this machine: namespaces share it) of `host`'s worker in the newest group, from its log."""
    attempt = events(workdir, "launch")[-1]["attempt"]
    path = os.path.join(workdir, "logs", f"attempt{attempt}_{host}.log")

    def pid():
        if os.path.exists(path):
            found = re.search(rf"attempt {attempt} pid (\d+):", read(path))
            return int(found.group(1)) if found else None

    return wait_until(pid, 60, f"{host}'s worker of group {attempt}")


def after(workdir: str, kind: str, t: float, **match) -> dict:
    """The first record of `kind` written after Unix time `t` whose fields match."""

    def find():
        return [r for r in events(workdir, kind) if r["time"] > t and all(r.get(k) == v for k, v in match.items())]

    return wait_until(find, 90, f"a {kind} record {match}")[0]


def test_ssh_kill_stop_and_readmission_through_sshd(tmp_path, bed, launched):
    """SIGKILL of host 1's worker while its sshd is down: the probe fails until sshd is back, then host 1 rejoins
    (through a warm standby where one is ready). Then host 2's worker is frozen: detected by heartbeat, replaced,
    re-admitted. The run ends with the state of an uninterrupted one."""
    wd = str(tmp_path / "run")
    h0, h1, h2 = bed.hosts
    run = launched(wd, ",".join(bed.hosts), ssh_args(bed, "--config.train.steps=150", "--config.train.ckpt_every=5"))
    wait_until(lambda: last_metric_step(wd) >= 10, 90, "step 10")
    bed.stop_sshd(1)
    t_kill = time.time()
    os.kill(worker_pid(wd, h1), signal.SIGKILL)
    fail = after(wd, "failure", t_kill)
    assert fail["hosts"] == [h1] and fail["reason"] == "exit code 137", fail  # 128 + 9 through ssh
    after(wd, "probe", t_kill, host=h1, ok=False)
    bed.start_sshd(1)
    after(wd, "readmit", t_kill, host=h1)
    back = after(wd, "recovery", t_kill, cause="readmit")
    assert back["group_size"] == 3

    t_stop = time.time()
    frozen = worker_pid(wd, h2)
    os.kill(frozen, signal.SIGSTOP)
    fail = after(wd, "failure", t_stop)
    assert fail["hosts"] == [h2] and fail["reason"] == "heartbeat lost", fail
    assert fail["time"] - t_stop < 8
    after(wd, "readmit", t_stop, host=h2)
    assert run.wait(150) == 0, run.output()
    assert not os.path.exists(f"/proc/{frozen}") or read(f"/proc/{frozen}/stat").split()[2] == "Z"
    recs = events(wd, "recovery")
    print("recoveries:", [(r["cause"], r["total_s"], r["split"]) for r in recs])
    assert [r["cause"] for r in recs] == ["failure", "readmit", "failure", "readmit"]
    assert all(sum(r["split"].values()) == pytest.approx(r["total_s"], abs=0.02) for r in recs)
    with open(os.path.join(wd, "fake_ckpt.json")) as f:
        final = json.load(f)
    assert final["step"] == 150 and final["w"] == pytest.approx(fake_w(150), rel=1e-12)


def test_partition_fences_off_the_cut_off_worker(tmp_path, bed, launched):
    """Host 2's link goes down while its worker keeps writing to metrics.jsonl (a thread of its own). The group
    relaunches on hosts 0 and 1 at once (not waiting for a kill that cannot arrive) and no line of the old group
    lands after the fence moved; the cut-off worker exits by itself. The run's secret is on no command line and
    in no file of the run."""
    wd = str(tmp_path / "run")
    h0, h1, h2 = bed.hosts
    args = ssh_args(bed, "--no-readmit", "--no-standby", f"--worker-arg=--fake.rogue={h2}")
    run = launched(wd, ",".join(bed.hosts), [*args, "--config.train.steps=80", "--config.train.ckpt_every=5"])
    wait_until(lambda: last_metric_step(wd) >= 10, 90, "step 10")
    with open(f"/proc/{worker_pid(wd, h0)}/environ", "rb") as f:
        secret = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)[b"REVE_SECRET"]
    t_cut = time.time()
    bed.partition(2)
    fence = after(wd, "fence", t_cut, attempt=1)
    fail = after(wd, "failure", t_cut)
    assert fail["hosts"] == [h2] and fail["reason"] == "heartbeat lost"
    assert any(r["host"] == h2 for r in events(wd, "fenced_off"))
    for pid in os.listdir("/proc"):  # every process of this machine, the namespaces' included
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert secret not in f.read(), f"the secret is on the command line of pid {pid}"
            except OSError:
                continue
    wait_until(lambda: not bed.pids(2, "elastic_fake_worker"), 15, "the cut-off worker to exit")
    assert run.wait(120) == 0, run.output()

    lines = read(os.path.join(wd, "metrics.jsonl")).splitlines()
    rogue = [r for r in map(json.loads, lines) if "rogue" in r]
    assert rogue and all(r["attempt"] == 0 for r in rogue)
    late = [r for r in rogue if r["time"] > fence["time"] + 0.05]
    assert not late, f"{len(late)} writes of the fenced-off group after the fence: {late[:3]}"
    rec = events(wd, "recovery")[0]
    print("partition recovery:", rec["total_s"], rec["split"])
    assert rec["split"]["kill"] < 3  # the group relaunched without waiting for the unreachable host
    assert events(wd, "launch")[-1]["hosts"] == [h0, h1]
    steps = metrics_by_step(wd)
    assert [steps[s]["loss"] for s in range(1, 81)] == pytest.approx([fake_w(s) for s in range(1, 81)])
    for dirpath, _, files in os.walk(wd):
        for name in files:
            if not os.path.islink(os.path.join(dirpath, name)):
                with open(os.path.join(dirpath, name), "rb") as f:
                    assert secret not in f.read(), f"the secret is in {name}"
    with open(os.path.join(wd, "launcher.log"), "rb") as f:
        assert secret not in f.read()


# ------------------------------------------------------------------------------------------------------- SLURM
@pytest.fixture
def slurm(tmp_path):
    from reve_jax.elastic.testbed_slurm import SlurmCluster

    if SlurmCluster.unavailable():
        pytest.skip(SlurmCluster.unavailable())
    # A root deeper than a Unix socket's path may be (pytest-xdist's worker directories made one): the cluster keeps
    # its sockets elsewhere.
    root = tmp_path / ("deep" * 20) / "slurm"
    with NetnsBed(3, str(tmp_path / "bed")) as b, SlurmCluster(b, str(root)) as cluster:
        yield b, cluster


def test_slurm_job_loses_a_node_and_continues(tmp_path, slurm):
    """The user's sbatch script (scripts/slurm/train.sbatch), submitted as it is on 3 nodes: the launcher runs one
    srun step per node; node 1's worker is killed and the run finishes on nodes 0 and 2."""
    bed, cluster = slurm
    wd = str(tmp_path / "run")
    n0, n1, n2 = bed.namespaces
    args = [
        "--workdir", wd, "--script", FAKE, "--devices-per-host", "2", "--no-readmit", *FAST,
        FAKE_STEP, "--config.train.steps=60", "--config.train.ckpt_every=5",
    ]  # fmt: skip
    output = str(tmp_path / "job.out")
    script = os.path.join(ROOT, "scripts", "slurm", "train.sbatch")
    job = cluster.sbatch(script, nodes=3, output=output, args=args, cwd=ROOT, env={"PYTHON": sys.executable})
    try:
        wait_until(lambda: last_metric_step(wd) >= 10, 90, "step 10")
        t_kill = time.time()
        os.kill(worker_pid(wd, n1), signal.SIGKILL)
        wait_until(lambda: cluster.job_state(job).startswith(("COMPLETED", "FAILED", "CANCELLED")), 120, "the job")
    finally:
        cluster.run(["scancel", job], check=False)
    assert cluster.job_state(job).startswith("COMPLETED"), read(output)
    (fail,) = events(wd, "failure")
    assert fail["hosts"] == [n1] and fail["time"] - t_kill < 10, fail
    assert events(wd, "launch")[-1]["hosts"] == [n0, n2]
    rec = events(wd, "recovery")[0]
    print("slurm recovery:", rec["total_s"], rec["split"])
    with open(os.path.join(wd, "fake_ckpt.json")) as f:
        final = json.load(f)
    assert final["step"] == 60 and final["w"] == pytest.approx(fake_w(60), rel=1e-12)


# ------------------------------------------------------------------------------------------ the real trainer
def compile_ahead(cache: str, devices: int, overrides: list[str]) -> None:
    """What the supervisor's compile-ahead job does, done before the run: one process with `devices` CPU
    devices compiles the step into `cache`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache, XLA_FLAGS=xla_flags(devices))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    argv = [sys.executable, "-m", "reve_jax.elastic.precompile", "--config", "configs/tiny.py", *overrides]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr


def test_real_trainer_recovers_from_a_kill_on_warm_standbys_and_compiled_ahead(tmp_path, launched):
    """scripts/train.py on 3 namespace hosts x 2 CPU devices (tiny model). The step for 2 hosts is compiled ahead
    by one process with 4 devices before the run, as the supervisor's compile-ahead job does during one (its job
    runs too, and finds it in the cache). Once every host has a warm standby, one host's worker is SIGKILLed: the
    new group is the standbys, it loads the step from the cache instead of compiling it, and trains on."""
    from test_elastic_e2e import TINY, TRAIN

    overrides = [a for a in TINY if not a.startswith(("--config.train.steps", "--config.train.ckpt_every"))]
    overrides += ["--config.train.steps=1000", "--config.train.ckpt_every=4"]
    compile_ahead(str(tmp_path / "jax_cache"), 4, overrides)
    with NetnsBed(3, str(tmp_path / "bed")) as bed:
        wd = str(tmp_path / "run")
        args = [
            "--remote-dir", ROOT, "--python", sys.executable, *[f"--ssh-arg={a}" for a in bed.ssh[1:]],
            "--devices-per-host", "2", "--heartbeat-timeout", "3", "--no-readmit", *overrides,
        ]  # fmt: skip
        run = launched(wd, ",".join(bed.hosts), args, script=TRAIN)
        wait_until(lambda: events(wd, "precompile") and events(wd, "standby_ready"), 240, "compile-ahead, standbys")
        assert events(wd, "precompile")[0]["hosts"] == 2 and events(wd, "precompile")[0]["code"] == 0
        victim = bed.hosts[1]
        pid = [r["pid"] for r in events(wd, "worker_pid") if r["host"] == victim][-1]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        rec = wait_until(lambda: events(wd, "recovery"), 120, "the recovery")[0]
        restored = rec["restored_step"]
        wait_until(lambda: last_metric_step(wd) >= restored + 3, 120, "three steps after the recovery")
        os.kill(run.proc.pid, signal.SIGTERM)  # stop cleanly: save and exit 2
        assert run.wait(120) == 2, run.output()
    spawn = events(wd, "spawn")[-1]
    print(f"real trainer on the bed: kill -> training again {rec['time'] - t_kill:.2f} s; split {rec['split']}")
    assert sorted(spawn["standby"]) == sorted(h for h in bed.hosts if h != victim), spawn  # "cold" says why not
    assert [r["reason"] for r in events(wd, "stopped")] == ["preempt"] and len(events(wd, "failure")) == 1
    assert rec["split"]["spawn"] < 2 and rec["split"]["compile"] < 15  # no interpreter start, no XLA compile
    compiled = r"compiled the train step for \d+x\d+ images in ([\d.]+)s"
    first, again = (
        float(re.search(compiled, read(os.path.join(wd, "logs", f"attempt{a}_{bed.hosts[0]}.log"))).group(1))
        for a in (0, 1)
    )
    assert again < first / 2, (first, again)  # the new group loaded what one process compiled ahead

"""The chaos soak: the real trainer under the elastic launcher on the namespace bed (testbed.py), hit again and
again by every kind of fault the bed can make, then checked (soakcheck.py). `scripts/chaos.py` is its command.

Faults (one at a time, on a host drawn at random, once the group trains at full size with its standbys ready):
  kill        SIGKILL of the host's worker
  stop        SIGSTOP of it (alive, silent: detected by heartbeat, fenced off, killed)
  partition   the host's link down until the run trains again without it (its worker is fenced off)
  sshd        the host's sshd stopped and its worker killed; probes fail until sshd is started again
  disk        the view of checkpoints/ of the host of process 0 (it makes each checkpoint's directory) becomes a full
              tmpfs (a copy of what was there, in the mount namespace of its worker only): its next save fails with
              ENOSPC, which hangs Orbax's asynchronous save until the supervisor's start-up grace (the phase is
              "saving") ends it; the disk is freed once the failure is seen
  corrupt     the newest checkpoint's array files truncated while the group is frozen, then every host "rebooted"
              (workers SIGKILLed, the run's snapshot sets gone from host memory), so the restore must read the disk,
              find the newest checkpoint undecodable, agree on it across processes, set it aside and use the one
              before
  supervisor  SIGTERM to the launcher (the group saves and exits, the launcher exits 2), then the same command again
After each fault the harness waits for the failed host to be re-admitted. Each row of the table: detect (fault ->
the supervisor's failure record; for `supervisor`, -> the launcher's exit), training again (fault -> the first
step of the new group: its `recovery` record, or its first logged step), steps lost (last step reached - step
restored).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from reve_jax.elastic import events as events_file
from reve_jax.elastic import snapstore, soakcheck
from reve_jax.xla import FAST_COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("kill", "stop", "partition", "sshd", "disk", "corrupt", "supervisor")
# A trainer small enough for 2 CPU cores; a global batch of 12 splits over 1, 2 or 3 hosts of 2 devices.
MODEL = [
    "--config.model.depth=1", "--config.model.width=32", "--config.model.heads=2", "--config.text.width=32",
    "--config.text.depth=1", "--config.text.heads=2", "--config.data.image_size=16", "--config.train.log_every=10",
    "--config.train.global_batch=12", "--config.train.sample_every=0", "--config.sample.num=0",
    "--config.sample.steps=1", "--config.train.peak_tflops=1", "--config.model.attention=xla",
    "--config.optim.warmup_steps=10",
    "--config.mesh.fsdp=2",  # the state sharded: every process writes (and snapshots) pieces of its own
]  # fmt: skip


class SoakError(RuntimeError):
    """The soak could not go on (a wait timed out, the launcher died)."""


@dataclasses.dataclass
class Settings:
    hosts: int = 3
    steps: int = 300  # at least; more when the faults need them (steps_needed)
    faults_per_kind: int = 10
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    ckpt_every: int = 10
    snapshot_every: int = 2
    heartbeat_timeout: float = 3.0
    probe_interval: float = 2.0
    # The launcher's grace for phases other than "train" (300 s by default, sized for a cluster's start-up). A full
    # disk under process 0 hangs Orbax's asynchronous save (its threads wait on signals that never come) and only
    # this grace ends it: the soak keeps it short.
    startup_timeout: float = 90.0
    rtol: float = 0.02  # the loss curve's largest relative difference allowed against the uninterrupted run
    timeout: float = 240.0  # s for any one wait
    # Before each fault, wait for the group to train on every host again (the failed one re-admitted) with its
    # standbys and the next size compiled ahead, as hours into a run. Off (the short form in the tests): a fault
    # comes once the group trains on 2 hosts or more, whatever else is going on.
    settle: bool = True

    def steps_needed(self) -> int:
        # Per fault: a few steps to train again at full size, up to a checkpoint interval for the re-admission's
        # stop, and the steps a fault loses; then room for the last re-admission.
        faults = self.faults_per_kind * len(self.kinds)
        if not self.settle:  # faults come two steps apart, whatever the group size
            return max(self.steps, 4 * faults + 2 * self.ckpt_every + 4)
        # Measured: a fault, the re-admission (at the next checkpoint) and the new standbys take ~20 steps.
        return max(self.steps, (2 * self.ckpt_every + 15) * faults + 3 * self.ckpt_every + 20)


def _wait(cond, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise SoakError(f"timed out after {timeout:.0f} s waiting for {what}")


def _run(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


class Soak:
    """One soak in `root` (the run directory, the bed, the reference run) on a NetnsBed `bed`."""

    def __init__(self, s: Settings, root: Path, bed):
        self.s, self.root, self.bed = s, root, bed
        self.wd = root / "run"
        self.steps = s.steps_needed()
        self.rng = random.Random(s.seed)
        self.launcher: subprocess.Popen | None = None
        self.launches = 0
        self.rows: list[dict] = []
        self.overrides = [*MODEL, f"--config.train.steps={self.steps}", f"--config.train.ckpt_every={s.ckpt_every}"]
        self.env = dict(os.environ, XLA_FLAGS=FAST_COMPILE_FLAGS, PYTHONPATH=ROOT)

    # ------------------------------------------------------------------------------------------- the run
    def argv(self) -> list[str]:
        return [
            sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--config", "configs/tiny.py",
            "--workdir", str(self.wd), "--script", os.path.join(ROOT, "scripts", "chaos.py"), "--worker-arg=--worker",
            "--hosts", ",".join(self.bed.hosts), "--remote-dir", ROOT, "--python", sys.executable,
            *[f"--ssh-arg={a}" for a in self.bed.ssh[1:]], "--devices-per-host", "2",
            "--heartbeat-timeout", str(self.s.heartbeat_timeout), "--probe-interval", str(self.s.probe_interval),
            "--startup-timeout", str(self.s.startup_timeout),
            "--max-strikes", "1000000",  # the faults are made here, not by bad hardware: never exclude a host
            "--snapshot-every", str(self.s.snapshot_every), *self.overrides,
        ]  # fmt: skip

    def start_launcher(self) -> None:
        self.wd.mkdir(parents=True, exist_ok=True)
        with open(self.wd / "launcher.log", "ab") as log:
            self.launcher = subprocess.Popen(
                self.argv(), cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.launches += 1

    def events(self, kind: str | None = None, after: float = 0.0) -> list[dict]:
        path = self.wd / "events.jsonl"
        out = events_file.read_events(str(path)) if path.exists() else []
        return [r for r in out if (kind is None or r["event"] == kind) and r["time"] > after]

    def group(self) -> tuple[int, list[str]]:
        launches = self.events("launch")
        return (launches[-1]["attempt"], launches[-1]["hosts"]) if launches else (-1, [])

    def worker_pids(self, attempt: int) -> dict[str, int]:
        return {r["host"]: r["pid"] for r in self.events("worker_pid") if r["attempt"] == attempt}

    def logged(self, attempt: int | None = None, after: float = 0.0) -> list[dict]:
        recs = soakcheck.read_positions(self.wd)
        return [r for r in recs if (attempt is None or r["attempt"] == attempt) and r["time"] > after]

    def last_step(self, attempt: int | None = None) -> int:
        return max((r["step"] for r in self.logged(attempt)), default=0)

    def alive(self) -> None:
        if self.launcher is not None and self.launcher.poll() is not None:
            raise SoakError(f"the launcher exited with {self.launcher.returncode}; see {self.wd}/launcher.log")

    def ready(self, timeout: float) -> tuple[int, list[str]]:
        """Waits until the group trains (two steps logged) on every host (`settle`) or on two at least; with
        `settle`, also for its standbys and for the step compiled ahead for one host fewer."""

        def training():
            self.alive()
            attempt, hosts = self.group()
            enough = sorted(hosts) == sorted(self.bed.hosts) if self.s.settle else len(hosts) >= 2
            steps = {r["step"] for r in self.logged(attempt)}
            return (attempt, hosts) if enough and len(steps) >= 2 else None

        attempt, hosts = _wait(training, timeout, "the group to train")
        if self.s.settle:
            _wait(lambda: [r for r in self.events("standby_ready") if r["attempt"] == attempt], timeout, "standbys")
            _wait(lambda: self._compiled(len(hosts) - 1), timeout, "the compile-ahead")
        return self.group()

    def _compiled(self, size: int) -> bool:
        return any(r["hosts"] == size and r["code"] == 0 for r in self.events("precompile"))

    # ------------------------------------------------------------------------------------------- faults
    def inject(self, kind: str) -> dict:
        attempt, hosts = self.ready(self.s.timeout)
        if kind == "corrupt":  # the restore must find an older checkpoint to fall back to
            _wait(lambda: len(self._checkpoints()) >= 2, self.s.timeout, "two checkpoints")
            attempt, hosts = self.group()
        victim = self.rng.randrange(len(hosts))
        host = hosts[0] if kind == "disk" else hosts[victim]
        pids = self.worker_pids(attempt)
        row = {"kind": kind, "host": host, "attempt": attempt, "step": self.last_step(attempt)}
        t = time.time()
        undo = getattr(self, f"_fault_{kind}")(victim, hosts, pids)
        try:
            row.update(self._measure(kind, t))
        finally:
            if undo is not None:
                undo()
        return row

    def _measure(self, kind: str, t: float) -> dict:
        if kind == "supervisor":
            return self._restart_launcher(t)
        wait = self.s.timeout + (self.s.startup_timeout if kind == "disk" else 0)  # a hung save: see Settings
        fail = _wait(lambda: self.events("failure", t), wait, f"the failure after {kind}")[0]
        rec = _wait(
            lambda: [r for r in self.events("recovery", t) if r["cause"] != "readmit"], self.s.timeout, "recovery"
        )[0]
        return {
            "detect_s": round(fail["time"] - t, 2),
            "again_s": round(rec["time"] - t, 2),
            "lost": rec["lost_steps"],
            "blamed": fail["hosts"],
            "restored": rec["restored_step"],
        }

    def _fault_kill(self, victim, hosts, pids):
        os.kill(pids[hosts[victim]], signal.SIGKILL)

    def _fault_stop(self, victim, hosts, pids):
        pid = pids[hosts[victim]]
        os.kill(pid, signal.SIGSTOP)
        return lambda: _kill_quietly(pid)  # normally gone already: the supervisor's kill reached it

    def _fault_partition(self, victim, hosts, pids):
        i = self.bed.hosts.index(hosts[victim])
        self.bed.partition(i)
        return lambda: self.bed.heal(i)

    def _fault_sshd(self, victim, hosts, pids):
        i = self.bed.hosts.index(hosts[victim])
        self.bed.stop_sshd(i)
        os.kill(pids[hosts[victim]], signal.SIGKILL)
        return lambda: (time.sleep(2 * self.s.probe_interval), self.bed.start_sshd(i))  # a failed probe first

    def _fault_disk(self, victim, hosts, pids):
        # Process 0 makes each checkpoint's directory, where the others then write: a full disk on its host fails
        # the save with ENOSPC. (A full view on another host would fail with ENOENT: process 0's directory is not
        # in that host's copy.)
        return full_disk(pids[hosts[0]], self.wd / "checkpoints", self.root / f"disk{time.time_ns()}")

    def _fault_corrupt(self, victim, hosts, pids):
        group = [pids[h] for h in hosts]
        for pid in group:  # frozen: no save completes and no snapshot moves while the files change
            os.kill(pid, signal.SIGSTOP)
        steps = self._checkpoints()
        for f in (self.wd / "checkpoints" / str(steps[-1]) / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d":  # the array chunks (ocdbt data files)
                with open(f, "r+b") as fh:
                    fh.truncate(f.stat().st_size // 3)
        # Every host's memory goes: any host left with its sets (this group's or an older one's) could restore a
        # complete snapshot and never read the disk.
        shutil.rmtree(self._snapshot_dir(), ignore_errors=True)
        for h in hosts:
            os.kill(pids[h], signal.SIGKILL)

    def _fault_supervisor(self, victim, hosts, pids):
        os.kill(self.launcher.pid, signal.SIGTERM)

    def _restart_launcher(self, t: float) -> dict:
        code = self._exit_code(self.s.timeout)
        stopped = time.time()
        if code != 2:
            raise SoakError(f"the launcher exited {code} after SIGTERM, not 2 (stopped); see {self.wd}/launcher.log")
        before = self.last_step()
        self._gone(60)
        self.start_launcher()
        first = _wait(lambda: self.logged(after=stopped), self.s.timeout, "training again after the restart")
        step = min(r["step"] for r in first)
        again = _wait(lambda: [r for r in self.logged(after=stopped) if r["step"] == step], 5, "the first step")
        return {"detect_s": round(stopped - t, 2), "again_s": round(max(r["time"] for r in again) - t, 2),
                "lost": before - (step - 1), "blamed": [], "restored": step - 1}  # fmt: skip

    def _exit_code(self, timeout: float) -> int:
        try:
            return self.launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SoakError(f"the launcher still runs after {timeout:.0f} s; see {self.wd}/launcher.log") from None

    def _gone(self, timeout: float) -> None:
        """Waits until no process of the run is left (they carry the run directory on their command line)."""
        try:
            _wait(lambda: not _processes_with(str(self.wd)), timeout, "the run's processes to go")
        except SoakError:
            left = [_cmdline(pid)[:200] for pid in _processes_with(str(self.wd))]
            raise SoakError(
                f"{len(left)} processes of the run still there {timeout:.0f} s after it ended: {left}"
            ) from None

    def _checkpoints(self) -> list[int]:
        d = self.wd / "checkpoints"
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []

    def _snapshot_dir(self) -> Path:
        token = (self.wd / ".snapshot_run").read_text().strip()
        return snapstore.default_root() / hashlib.sha256(token.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------------------- whole soak
    def schedule(self) -> list[str]:
        faults = [k for k in self.s.kinds for _ in range(self.s.faults_per_kind)]
        self.rng.shuffle(faults)
        return faults

    def run(self, say=print) -> dict:
        rows, problems = self.rows, []
        self.start_launcher()
        try:
            for n, kind in enumerate(self.schedule(), 1):
                row = self.inject(kind)
                rows.append(row)
                say(_row_line(n, row))
            code = self._exit_code(self.s.timeout + 5 * self.steps)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait(timeout=30)
            raise  # the bed's close kills what ran on the hosts
        self._gone(60)  # what outlives a finished run is a leftover: found here, before the bed's close kills it
        finish = self.events("finish")
        if code != 0 or not finish or finish[-1]["status"] != "finished":
            problems.append(f"the launcher exited {code}, finish {finish[-1] if finish else None}")
        if self._checkpoints()[-1:] != [self.steps]:
            problems.append(f"the last checkpoint is {self._checkpoints()[-1:]}, not step {self.steps}")
        return {"rows": rows, "problems": problems, "steps": self.steps, "launches": self.launches}

    def reference(self) -> Path:
        """The same config trained without interruption: one process with all the bed's devices."""
        ref = self.root / "reference"
        env = dict(self.env, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count={2 * self.s.hosts}"
        env["JAX_COMPILATION_CACHE_DIR"] = str(self.root / "jax_cache")
        argv = [sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--worker", "--config", "configs/tiny.py",
                "--workdir", str(ref), *self.overrides]  # fmt: skip
        with open(self.root / "reference.log", "wb") as log:
            code = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600
            ).returncode
        if code:
            raise SoakError(f"the reference run failed ({code}); see {self.root / 'reference.log'}")
        return ref


def soak(s: Settings, root: Path, say=print) -> dict:
    """The whole soak in `root`: the bed, the run and its faults, the uninterrupted reference, every check.
    Returns the report: rows (one per fault), problems (empty when every check passed), loss statistics,
    leftovers."""
    from reve_jax import config as config_lib
    from reve_jax.elastic.testbed import NetnsBed

    pid_dir = Path.home() / ".cache" / "reve_jax" / "pids"
    pid_files = set(os.listdir(pid_dir)) if pid_dir.is_dir() else set()
    finished = False
    try:
        with NetnsBed(s.hosts, str(root / "bed")) as bed:
            runner = Soak(s, root, bed)
            try:
                # The reference first: it compiles the step for the whole group's device count into the run's
                # cache, where the first launch finds it (the key does not depend on the process layout,
                # xla.share_executables_between_processes), instead of compiling it twice.
                ref = runner.reference()
                report = runner.run(say)
            except SoakError as e:
                report = {"rows": runner.rows, "problems": [f"the soak stopped: {e}"], "steps": runner.steps}
            namespaces = list(bed.namespaces)
        finished = True
    finally:
        if not finished:  # interrupted (SIGTERM, Ctrl-C): nothing of the unfinished run may stay behind
            _clean_up(root / "run", pid_dir, pid_files)
    report.update(loss={}, leftovers=[])
    cfg = config_lib.load_config(os.path.join(ROOT, "configs", "tiny.py"), runner.overrides)
    batch = cfg.train.global_batch
    if not report["problems"]:
        got, problems = soakcheck.lineage(soakcheck.read_positions(runner.wd), runner.steps, batch, data_order(cfg))
        report["problems"] += problems
        report["redone_steps"] = sum(v["redone"] > 1 for v in got.values())
        want, problems = soakcheck.lineage(soakcheck.read_positions(ref), runner.steps, batch)
        report["problems"] += [f"reference: {p}" for p in problems]
        report["loss"], problems = soakcheck.compare_losses(got, want, s.rtol)
        report["problems"] += problems
    shm = [runner._snapshot_dir()] if (runner.wd / ".snapshot_run").exists() else []
    report["leftovers"] = soakcheck.leftovers([str(runner.wd), str(root / "bed")], namespaces, shm, pid_files)
    report["problems"] += [f"left behind: {x}" for x in report["leftovers"][:20]]
    report["table"] = table(report["rows"])
    return report


def _clean_up(wd: Path, pid_dir: Path, pid_files: set[str]) -> None:
    """After an interrupted soak (the bed closed): the run's snapshot sets, and the pid files of the remote shells
    the bed's close killed."""
    token = wd / ".snapshot_run"
    if token.exists():
        run_dir = snapstore.default_root() / hashlib.sha256(token.read_text().strip().encode()).hexdigest()[:16]
        shutil.rmtree(run_dir, ignore_errors=True)
    if pid_dir.is_dir():
        for name in set(os.listdir(pid_dir)) - pid_files:
            with contextlib.suppress(OSError):
                os.unlink(pid_dir / name)


def data_order(cfg):
    """position -> the sample index the data pipeline puts there (its stages' order), for the lineage check."""
    from reve_jax.data import pipeline

    batch = cfg.train.global_batch
    stages = pipeline.make_stages(cfg.data, batch)

    def order(position: int) -> int:
        g, row = divmod(position, batch)
        stage = stages[pipeline._stage_index(stages, g)]
        return int(stage.order(g - stage.start_step, row))

    return order


def full_disk(pid: int, directory: Path, backing: Path):
    """Makes `directory` a full tmpfs (holding a copy of what it holds now) in the mount namespace of process
    `pid` only; returns the function that undoes it. Inodes are capped too, so creating a file or directory fails
    with ENOSPC as writing does."""
    backing.mkdir(parents=True)
    entries = sum(len(d) + len(f) for _, d, f in os.walk(directory)) + 3
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) + (4 << 20)
    # Held open, the namespace outlives the worker (the supervisor kills it long before the undo), and the undo
    # reaches the same namespace whoever runs in it then.
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    ns = ["nsenter", f"--mount=/proc/{os.getpid()}/fd/{fd}", "--"]
    script = (
        f"mount -t tmpfs -o size={size},nr_inodes={entries} tmpfs {backing} && "
        f"(cp -a {directory}/. {backing}/ 2>/dev/null; dd if=/dev/zero of={backing}/.fill bs=64k 2>/dev/null; true) "
        f"&& mount --bind {backing} {directory}"
    )
    done = _run([*ns, "sh", "-c", script])
    if done.returncode:
        os.close(fd)
        shutil.rmtree(backing, ignore_errors=True)
        raise SoakError(f"could not fill the disk of process {pid}: {done.stderr.strip()}")

    def undo():
        try:
            done = _run([*ns, "sh", "-c", f"umount {directory} && umount {backing}"])
        finally:
            os.close(fd)
        if done.returncode:
            raise SoakError(f"could not free the full disk of {directory}: {done.stderr.strip()}")
        backing.rmdir()

    return undo


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _processes_with(needle: str) -> list[int]:
    return [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if int(p) != os.getpid() and needle in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _row_line(n: int, r: dict) -> str:
    return (f"fault {n:3d} {r['kind']:10s} on {r['host']} at step {r['step']}: detect {r['detect_s']:.2f} s, "
            f"training again {r['again_s']:.2f} s, {r['lost']} steps lost (restored {r['restored']})")  # fmt: skip


def table(rows: list[dict]) -> str:
    """Per fault kind: faults, then median and max of detect, training again and steps lost."""
    head = "| fault | n | detect s (median, max) | training again s (median, max) | steps lost (median, max) |"
    lines = [head, "|---|---|---|---|---|"]
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        cells = []
        for k in ("detect_s", "again_s", "lost"):
            vals = [r[k] for r in rs]
            cells.append(f"{statistics.median(vals):g}, {max(vals):g}")
        lines.append(f"| {kind} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))

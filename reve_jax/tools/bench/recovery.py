"""The logic of scripts/bench_recovery.py: recoveries of the elastic launcher timed fault by fault."""

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from reve_jax.elastic import events as events_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPLIT = ("detect", "kill", "spawn", "join", "restore", "compile", "first_step")

TINY = [
    "--config.model.depth=1", "--config.model.width=32", "--config.model.heads=2", "--config.text.width=32",
    "--config.text.depth=1", "--config.text.heads=2", "--config.data.image_size=16",
    "--config.train.log_every=1", "--config.train.global_batch=24", "--config.train.sample_every=0",
    "--config.sample.num=2", "--config.sample.steps=1", "--config.train.peak_tflops=1",
    "--config.model.attention=xla",
]  # fmt: skip


def read_events(workdir: str, kind: str | None = None) -> list[dict]:
    path = os.path.join(workdir, "events.jsonl")
    out = events_file.read_events(path) if os.path.exists(path) else []
    return [r for r in out if kind is None or r["event"] == kind]


def newest_step(workdir: str) -> int:
    """The last step process 0 logged to metrics.jsonl (-1 before the first)."""
    path = os.path.join(workdir, "metrics.jsonl")
    steps = [-1]
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError):
                    steps.append(int(json.loads(line)["step"]))
    return steps[-1]


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"bench: timed out after {timeout:.0f} s waiting for {what}")


def kill_run(workdir: str) -> None:
    """SIGKILLs every process of the run on this machine (the namespaces share its process table): workers,
    standbys and compile-ahead jobs all carry the workdir on their command line."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if workdir.encode() in f.read() and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def one_run(args, fault: str, rep: int, bed) -> dict:
    real = args.trainer == "real"
    rng = random.Random(f"{args.seed}-{fault}-{rep}")
    steps, every = (400, 4) if real else (400, 10)
    workdir = os.path.join(args.workdir, f"{fault}{rep}")
    os.makedirs(workdir)
    hosts = bed.hosts if bed else [f"local{i}" for i in range(args.hosts)]
    victim = rng.randrange(len(hosts))
    fault_step = rng.randint(every + 1, 2 * every + 1)
    script = (
        os.path.join(ROOT, "scripts", "train.py") if real else os.path.join(ROOT, "tests", "elastic_fake_worker.py")
    )
    where = (
        ["--hosts", ",".join(hosts), "--remote-dir", ROOT, "--python", sys.executable, "--devices-per-host", "2",
         *[f"--ssh-arg={a}" for a in bed.ssh[1:]]]
        if bed else ["--hosts", str(args.hosts), "--devices-per-host", "2"]
    )  # fmt: skip
    argv = [
        sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--config", "configs/tiny.py",
        "--workdir", workdir, "--script", script, *where, "--no-readmit", "--heartbeat-timeout", str(args.heartbeat),
        "--group-sizes", "auto" if real else "any", f"--config.train.steps={steps}",
        f"--config.train.ckpt_every={every}", *(TINY if real else ["--worker-arg=--fake.step_time=0.1"]),
        *(["--no-fast-recovery"] if args.no_fast_recovery else []),
        *([f"--config.elastic.snapshot_every={args.snapshot_every}"] if args.snapshot_every else []),
        *([f"--config.elastic.snapshot_dir={os.path.join(workdir, 'shm')}"] if args.snapshot_every else []),
    ]  # fmt: skip
    with open(os.path.join(workdir, "launcher.log"), "ab") as log:
        launcher = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait(lambda: newest_step(workdir) >= fault_step, args.timeout, f"step {fault_step}")
        if not args.no_fast_recovery:  # ready as it would be hours into a run
            if real:
                wait(lambda: read_events(workdir, "precompile"), args.timeout, "the compile-ahead")
            wait(lambda: read_events(workdir, "standby_ready"), args.timeout, "the standbys")
        attempt = read_events(workdir, "launch")[-1]["attempt"]
        pids = {r["host"]: r["pid"] for r in read_events(workdir, "worker_pid") if r["attempt"] == attempt}
        t_fault = time.time()
        if fault == "partition":
            bed.partition(victim)
        else:
            os.kill(pids[hosts[victim]], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        rec = wait(lambda: read_events(workdir, "recovery"), args.timeout, "the recovery")[0]
        fail = read_events(workdir, "failure")[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        kill_run(workdir)
        if bed and fault == "partition":
            bed.heal(victim)
    return {
        **rec["split"],
        "total_s": rec["total_s"],  # the split's sum: from the fault as the supervisor dates it (last beat, exit)
        "wall": rec["time"] - t_fault,  # from the moment the fault was made -> every new process did a step
        "detected_wall": fail["time"] - t_fault,
        "lost_steps": rec["lost_steps"],
        "group": f"{len(hosts)} -> {rec['group_size']}",
        "victim": hosts[victim],
    }


def main(argv=None, doc: str = __doc__) -> int:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("fake", "real"), default="fake")
    p.add_argument("--bed", choices=("local", "netns"), default="local")
    p.add_argument("--fault", default="kill", help="comma list of kill, stop, partition (netns only)")
    p.add_argument("--repeat", type=int, default=1, help="runs per fault (the table shows medians)")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--heartbeat", type=float, default=3.0, help="the launcher's --heartbeat-timeout (s)")
    p.add_argument("--seed", type=int, default=0, help="picks the victim and the step")
    p.add_argument("--no-fast-recovery", action="store_true", help="the launcher's flag: measure 'before'")
    p.add_argument("--snapshot-every", type=int, default=0, help="real trainer: elastic.snapshot_every (0: off)")
    p.add_argument("--workdir", default="")
    p.add_argument("--timeout", type=float, default=600.0, help="s to wait for any one thing")
    args = p.parse_args(argv)
    faults = args.fault.split(",")
    if "partition" in faults and args.bed != "netns":
        p.error("a partition needs --bed netns")
    args.workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_recovery_"))
    os.makedirs(args.workdir, exist_ok=True)
    print(f"bench: {args.trainer} worker on {args.bed} x {args.hosts} hosts, faults {faults} x {args.repeat}, "
          f"{'no fast recovery' if args.no_fast_recovery else 'fast recovery'}; load {os.getloadavg()[0]:.1f}; "
          f"runs in {args.workdir}", flush=True)  # fmt: skip
    with contextlib.ExitStack() as stack:
        bed = None
        if args.bed == "netns":
            from reve_jax.elastic.testbed import NetnsBed

            why = NetnsBed.unavailable()
            if why:
                raise SystemExit(f"bench: no namespace bed here: {why}")
            bed = stack.enter_context(NetnsBed(args.hosts, os.path.join(args.workdir, "bed")))
        results = {}
        for fault in faults:
            results[fault] = []
            for rep in range(args.repeat):
                r = one_run(args, fault, rep, bed)
                results[fault].append(r)
                print(f"{fault} {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float))
                      + f"; lost {r['lost_steps']} steps, {r['group']}, victim {r['victim']}", flush=True)  # fmt: skip
    print(f"\nmedians (s), load {os.getloadavg()[0]:.1f} at the end")
    head = ["fault", "runs", *SPLIT, "sum", "fault made -> training", "lost steps"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for fault, rs in results.items():
        cells = [f"{statistics.median(r[k] for r in rs):.2f}" for k in (*SPLIT, "total_s", "wall")]
        cells.append(f"{statistics.median(r['lost_steps'] for r in rs):g}")
        print(f"| {fault} | {len(rs)} | " + " | ".join(cells) + " |")
    return 0

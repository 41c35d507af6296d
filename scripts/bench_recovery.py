"""Measure one recovery: launch a local elastic run, SIGKILL one worker at a random step, and print how long the
supervisor took to detect it, to restart, restore and reach the first step again, and the steps of work lost.

    python scripts/bench_recovery.py                       # fake worker: 4 hosts x 2 CPU devices
    python scripts/bench_recovery.py --trainer real        # scripts/train.py with configs/tiny.py made tiny
    python scripts/bench_recovery.py --seed 3 --hosts 3 --workdir runs/bench

The run's events stay in <workdir>/events.jsonl and its logs in <workdir>/logs/.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from reve_jax.elastic import events as events_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "--config.model.depth=1", "--config.model.width=32", "--config.model.heads=2", "--config.text.width=32",
    "--config.text.depth=1", "--config.text.heads=2", "--config.data.image_size=16",
    "--config.train.log_every=1", "--config.train.global_batch=24", "--config.train.sample_every=0",
    "--config.sample.num=2", "--config.sample.steps=1", "--config.train.peak_tflops=1",
    "--config.model.attention=xla",
]  # fmt: skip


def read_events(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "events.jsonl")
    return events_file.read_events(path) if os.path.exists(path) else []


def newest_step(workdir: str) -> int:
    """The last step process 0 logged to metrics.jsonl (-1 before the first)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return -1
    with open(path) as f:
        lines = f.read().splitlines()
    try:
        return int(json.loads(lines[-1])["step"]) if lines else -1
    except ValueError:
        return -1


def wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"bench: timed out after {timeout:.0f} s waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("fake", "real"), default="fake")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=0, help="run length (default 80 fake, 16 real)")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint cadence (default 10 fake, 4 real)")
    p.add_argument("--seed", type=int, default=None, help="picks the step and the host to kill")
    p.add_argument("--gpus-per-host", type=int, default=0, help="GPUs per local process (default: CPU devices)")
    p.add_argument("--readmit", action="store_true", help="the killed host may rejoin once its probe passes")
    p.add_argument("--no-precompile", action="store_true", help="no compile-ahead (the launcher's flag)")
    p.add_argument("--workdir", default="")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    real = args.trainer == "real"
    steps = args.steps or (16 if real else 80)
    every = args.ckpt_every or (4 if real else 10)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_recovery_"))
    kill_step = rng.randint(every + 1, max(every + 1, steps // 2))
    victim = f"local{rng.randrange(args.hosts)}"
    marker_dir = os.path.join(workdir, "broken")
    os.makedirs(marker_dir, exist_ok=True)
    if not args.readmit:
        open(os.path.join(marker_dir, victim), "w").close()  # the killed host stays out: one recovery to time
    script = (
        os.path.join(ROOT, "scripts", "train.py") if real else os.path.join(ROOT, "tests", "elastic_fake_worker.py")
    )
    argv = [
        sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--config", "configs/tiny.py",
        "--workdir", workdir, "--hosts", str(args.hosts), "--script", script, "--marker-dir", marker_dir,
        "--group-sizes", "auto" if real else "any", "--probe-interval", "1", f"--config.train.steps={steps}",
        f"--config.train.ckpt_every={every}", f"--gpus-per-host={args.gpus_per_host}",
        *(TINY if real else ["--worker-arg=--fake.step_time=0.1"]),
        *(["--no-precompile"] if args.no_precompile else []),
    ]  # fmt: skip
    print(
        f"bench: {args.trainer} worker, {args.hosts} hosts, {steps} steps, checkpoint every {every}; "
        f"killing {victim} at step {kill_step}; workdir {workdir}",
        flush=True,
    )
    with open(os.path.join(workdir, "launcher.log"), "ab") as log:
        launcher = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait(lambda: newest_step(workdir) >= kill_step, args.timeout, f"step {kill_step}")
            if real and not args.no_precompile:  # a failure hours into a run finds the next size compiled
                ahead = lambda: any(r["event"] == "precompile" for r in read_events(workdir))  # noqa: E731
                wait(ahead, args.timeout, "compile-ahead")
            spawn = [r for r in read_events(workdir) if r["event"] == "spawn"][-1]
            t_kill = time.time()
            os.kill(spawn["pids"][victim], signal.SIGKILL)
            rec = wait(
                lambda: [r for r in read_events(workdir) if r["event"] == "recovery"], args.timeout, "the recovery"
            )[0]
            fail = [r for r in read_events(workdir) if r["event"] == "failure"][0]
            code = launcher.wait(timeout=args.timeout)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    rows = [
        ("kill -> failure detected (wall)", f"{fail['time'] - t_kill:7.2f} s"),
        ("  detection (policy's view)", f"{rec['detection_s']:7.2f} s"),
        ("  restart (kill group, spawn, connect)", f"{rec['restart_s']:7.2f} s"),
        ("  restore (jax init, mesh, checkpoint)", f"{rec['restore_s']:7.2f} s"),
        ("  first step (compile, first step)", f"{rec['first_step_s']:7.2f} s"),
        ("kill -> training again (wall)", f"{rec['time'] - t_kill:7.2f} s"),
        ("steps lost", f"{rec['lost_steps']:7d}   ({rec['last_step']} reached, {rec['restored_step']} restored)"),
        ("group", f"{args.hosts} -> {rec['group_size']} hosts; launcher exit code {code}"),
    ]
    for name, value in rows:
        print(f"{name:40s} {value}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""The logic of scripts/bench_snapshot.py: the step-time cost of in-memory snapshots, runs without and with them."""

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = [
    "--config.model.depth=1", "--config.model.width=32", "--config.model.heads=2", "--config.text.width=32",
    "--config.text.depth=1", "--config.text.heads=2", "--config.data.image_size=16", "--config.train.global_batch=24",
]  # fmt: skip
COMMON = [
    "--config.train.log_every=1", "--config.train.sample_every=0", "--config.sample.num=2", "--config.sample.steps=1",
    "--config.sample.score_num=0", "--config.train.peak_tflops=1", "--config.model.attention=xla",
]  # fmt: skip


def run_once(args, every: int, tag: str) -> dict:
    workdir = os.path.join(args.workdir, tag)
    argv = [
        sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--config", "configs/tiny.py",
        "--workdir", workdir, "--hosts", str(args.hosts), "--devices-per-host", "2", "--no-readmit",
        "--no-precompile", "--group-sizes", "any", f"--config.train.steps={args.steps}",
        f"--config.train.ckpt_every={10 * args.steps}", f"--config.elastic.snapshot_every={every}",
        f"--config.elastic.snapshot_dir={os.path.join(args.workdir, 'shm')}",
        *(SMALL if args.model == "small" else []), *COMMON,
    ]  # fmt: skip
    os.makedirs(workdir)
    with open(os.path.join(workdir, "launcher.log"), "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise SystemExit(f"bench: run {tag} ended with {code}; see {workdir}/launcher.log")
    times = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "step_time" in rec and rec["step"] > args.skip:
                times[rec["step"]] = rec["step_time"]
    out = {"step_s": statistics.median(times.values()), "steps": len(times)}
    if every > 1:  # the snapshot taken after step s runs behind step s + 1
        after = [t for s, t in times.items() if (s - 1) % every == 0]
        other = [t for s, t in times.items() if (s - 1) % every != 0]
        out["after_snapshot_s"], out["other_s"] = statistics.median(after), statistics.median(other)
    with open(os.path.join(workdir, "logs", "attempt0_local0.log")) as f:
        text = f.read()
    m = re.search(r"snapshots: (\d+) taken, (\d+) skipped.*main thread ([\d.]+) ms, to host ([\d.]+) ms, "
                  r"write ([\d.]+) ms, push ([\d.]+) ms; thread CPU ([\d.]+) ms, receiving the predecessor's "
                  r"([\d.]+) ms", text)  # fmt: skip
    if m:
        out.update(zip(("taken", "skipped"), map(int, m.groups()[:2]), strict=True))
        names = ("main_ms", "host_ms", "write_ms", "push_ms", "cpu_ms", "receive_cpu_ms")
        out.update(zip(names, map(float, m.groups()[2:]), strict=True))
    cpu = re.search(r"'train_cpu_s': ([\d.]+)", text)  # process 0's CPU seconds on the train clock
    if cpu:
        out["step_cpu_s"] = float(cpu.group(1)) / args.steps
    return out


def main(argv=None, doc: str = __doc__) -> int:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2, help="runs without and with snapshots, interleaved")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (compile, warm-up)")
    p.add_argument("--every", type=int, default=2, help="elastic.snapshot_every of the runs with snapshots")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--workdir", default="")
    p.add_argument("--timeout", type=float, default=600.0, help="s for one run")
    p.add_argument("--dry-run", action="store_true", help="check the options, then exit")
    args = p.parse_args(argv)
    if args.dry_run:
        print(f"dry run: would run {args.pairs} pairs of {args.steps}-step runs on {args.hosts} x 2 devices "
              f"({args.model} model), snapshots every {args.every} step(s) in one of each pair")  # fmt: skip
        return 0
    args.workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_snapshot_"))
    os.makedirs(args.workdir, exist_ok=True)
    print(f"bench: {args.pairs} pairs, {args.steps} steps, {args.hosts} x 2 devices, {args.model} model; "
          f"load {os.getloadavg()[0]:.1f}; runs in {args.workdir}", flush=True)  # fmt: skip
    off, on = [], []
    for i in range(args.pairs):
        for every, into in ((0, off), (args.every, on)):
            r = run_once(args, every, f"every{every}_{i}")
            into.append(r)
            print(f"snapshot_every={every} run {i}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
    base = statistics.median(r["step_s"] for r in off)
    with_ = statistics.median(r["step_s"] for r in on)
    main_ms = statistics.median(r.get("main_ms", 0.0) for r in on)
    share = 100 * main_ms / 1e3 / base
    print(f"\nmedian step {1e3 * base:.1f} ms without snapshots, {1e3 * with_:.1f} ms with one every {args.every} "
          f"step(s): {100 * (with_ / base - 1):+.1f}% (main thread {main_ms:.1f} ms = {share:.1f}% of a step); "
          f"load {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    if all("cpu_ms" in r and "step_cpu_s" in r for r in on):
        cpu = statistics.median((r["main_ms"] + r["cpu_ms"] + r["receive_cpu_ms"]) / 1e3 / r["step_cpu_s"] for r in on)
        print(f"CPU of one snapshot (main thread + its thread + receiving the predecessor's) / a step's process CPU: "
              f"{100 * cpu:.1f}%; amortized over {args.every} steps {100 * cpu / args.every:.1f}%")  # fmt: skip
    if args.every > 1:
        per = [r["after_snapshot_s"] / r["other_s"] - 1 for r in on]
        print(f"within runs: a step behind a snapshot takes {100 * statistics.median(per):+.1f}% longer than one "
              f"without (per run: {', '.join(f'{100 * x:+.1f}%' for x in per)}); amortized over {args.every} steps "
              f"{100 * statistics.median(per) / args.every:+.1f}% of a step")  # fmt: skip
    return 0

"""What the chaos soak (chaos.py) proves after a run: the trainer's worker that logs every step's data, and the
checks on those logs.

The worker (`worker_main`, run as `scripts/chaos.py --worker ...` by the launcher) is scripts/train.py with one
more loop hook: after every step, each process appends to `<workdir>/positions/a<attempt>_p<process>.jsonl`
which global data positions the batch it just trained on held (its rows: a contiguous range, counted from the
position the data pipeline was started at after the restore, not from the step) and which samples they were
(`index`), with the loss on process 0. The lines are written under the run directory, so the fence guards them:
a superseded process logs nothing more. A step's lines are written before its snapshot and checkpoint hooks
run, so a state restored at step r had every process's line of every step up to r written.

The checks:
- `lineage`: the steps the final state went through. A step may be trained more than once (lost steps are
  redone after a restore); the latest attempt that logged it is taken as the surviving one (an earlier one's
  result can survive only where it trained the same step from the same positions). Its processes' ranges must
  tile the step's global batch exactly, so every data position of the run is trained exactly once along it.
- `compare_losses`: the lineage's per-step loss against an uninterrupted run of the same config.
- `leftovers`: processes, namespaces, mounts, snapshot files and temporary directories of the run still there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import numpy as np

POSITIONS = "positions"


# ------------------------------------------------------------------------------------------- the worker
class PositionLog:
    """The loop hook (loop.py) that logs each step's data positions, and the wrapper of the data pipeline that
    tells it which batch a step consumed."""

    timed = True  # a small append per step: it stays on the train clock

    def __init__(self, workdir, attempt: int, process: int, processes: int, global_batch: int):
        self.path = Path(workdir) / POSITIONS / f"a{attempt:06d}_p{process:05d}.jsonl"
        self.attempt, self.process, self.processes, self.batch = attempt, process, processes, global_batch
        self.pending: collections.deque = collections.deque()  # ([first, end) positions, samples) per batch made

    def wrap(self, host_batches):
        """Run.host_batches, recording for every batch it makes the positions of this process's rows (from the
        position the pipeline starts at) and their samples, in order: the loop consumes them in that order."""
        log = self

        def logged(run, position: int):
            local = log.batch // log.processes
            for k, batch in enumerate(host_batches(run, position)):
                start = position + k * log.batch + log.process * local
                log.pending.append(([start, start + local], [int(i) for i in np.asarray(batch["index"]).reshape(-1)]))
                yield batch

        return logged

    def due(self, ctx) -> bool:
        return True

    def __call__(self, ctx) -> None:
        positions, index = self.pending.popleft()  # the batch this step trained on
        rec = {"step": ctx.step, "attempt": self.attempt, "process": self.process, "processes": self.processes}
        rec.update(positions=positions, index=index, time=round(time.time(), 3))
        if self.process == 0:
            rec["loss"] = ctx.host_metrics()["loss"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # opened per line, as metrics.jsonl: each write passes the fence
            f.write(json.dumps(rec) + "\n")


def worker_main(argv: list[str]) -> int:
    """scripts/train.py with a PositionLog hook (the launcher's --script scripts/chaos.py --worker-arg=--worker)."""
    p = argparse.ArgumentParser(prog="chaos.py --worker")
    p.add_argument("--config", required=True)
    p.add_argument("--workdir", required=True)
    args, overrides = p.parse_known_args(argv)
    from reve_jax import cli
    from reve_jax.train import builder, trainer

    worker = cli.start_worker()  # first: a standby waits here for its place in a group
    if worker is None:  # the uninterrupted reference: its executable is cached under the key the group's use
        from reve_jax import xla

        xla.share_executables_between_processes()
    cfg = cli.load_config_or_exit(args.config, overrides)
    import jax

    hook = PositionLog(
        args.workdir, getattr(worker, "attempt", 0), jax.process_index(), jax.process_count(), cfg.train.global_batch
    )
    builder.Run.host_batches = hook.wrap(builder.Run.host_batches)
    run = trainer.run
    trainer.run = lambda *a, **kw: run(*a, extra_hooks=[hook], **kw)  # what cli.train calls
    cli.train(cfg, args.workdir, worker)
    return 0


# ------------------------------------------------------------------------------------------- the checks
def read_positions(workdir) -> list[dict]:
    out = []
    for path in sorted((Path(workdir) / POSITIONS).glob("a*_p*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line torn by a SIGKILL: that step was not finished on this process
                    continue
    return out


def lineage(records: list[dict], steps: int, global_batch: int, order=None) -> tuple[dict[int, dict], list[str]]:
    """Per step 1..`steps`, the surviving training of it: {"attempt", "loss", "time"}; and the problems found:
    a step never trained, processes whose ranges do not tile the step's global batch, samples other than
    `order(position)` (when given), a data position trained twice or never along the lineage."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for r in records:
        by_step.setdefault(r["step"], {}).setdefault(r["attempt"], []).append(r)
    out, problems, seen = {}, [], np.zeros(steps * global_batch, np.int32)
    for s in range(1, steps + 1):
        if s not in by_step:
            problems.append(f"step {s} was never trained")
            continue
        attempt = max(by_step[s])
        recs = by_step[s][attempt]
        n = recs[0]["processes"]
        got = sorted((r["process"], tuple(r["positions"])) for r in recs)
        base, local = (s - 1) * global_batch, global_batch // n
        want = [(p, (base + p * local, base + (p + 1) * local)) for p in range(n)]
        if got != want:
            problems.append(f"step {s} (attempt {attempt}): processes logged {got}, the batch is {want}")
            continue
        for r in recs:
            lo, hi = r["positions"]
            seen[lo:hi] += 1
            if order is not None and r["index"] != [order(q) for q in range(lo, hi)]:
                problems.append(f"step {s} process {r['process']}: samples {r['index']} are not positions {lo}..{hi}")
        loss = next((r["loss"] for r in recs if "loss" in r), None)
        out[s] = {"attempt": attempt, "loss": loss, "time": max(r["time"] for r in recs), "redone": len(by_step[s])}
    twice, never = np.flatnonzero(seen > 1), np.flatnonzero(seen == 0)
    if len(twice):
        problems.append(f"{len(twice)} data positions trained more than once along the lineage, e.g. {twice[:5]}")
    if len(never) and not any(p.startswith("step") for p in problems):
        problems.append(f"{len(never)} data positions never trained, e.g. {never[:5]}")
    return out, problems


def compare_losses(got: dict[int, dict], want: dict[int, dict], rtol: float) -> tuple[dict, list[str]]:
    """The per-step loss of the soak's lineage (`got`) against an uninterrupted run (`want`): max and median
    relative difference; a problem when the max exceeds `rtol` or a step is missing."""
    steps = sorted(want)
    missing = [s for s in steps if got.get(s, {}).get("loss") is None]
    if missing:
        return {}, [f"no loss for steps {missing[:5]} ({len(missing)} in all)"]
    rel = np.array([abs(got[s]["loss"] - want[s]["loss"]) / max(abs(want[s]["loss"]), 1e-12) for s in steps])
    worst = steps[int(np.argmax(rel))]
    stats = {"max_rel": float(rel.max()), "median_rel": float(np.median(rel)), "worst_step": worst}
    problems = []
    if rel.max() > rtol:
        problems.append(
            f"loss differs from the uninterrupted run by {rel.max():.2%} at step {worst} "
            f"({got[worst]['loss']:.6f} against {want[worst]['loss']:.6f}), more than the tolerance {rtol:.2%}"
        )
    return stats, problems


def leftovers(needles: list[str], namespaces: list[str], shm_dirs: list[Path], pid_files: set[str]) -> list[str]:
    """What the run left behind: processes whose command line holds one of `needles` (the run directory, the bed
    directory), namespaces of the bed, mounts under `needles`, files under `shm_dirs` (the run's snapshot
    directories), pid files in ~/.cache/reve_jax/pids other than `pid_files` (those there before the run) unless
    the process they name is alive and another run's (the directory is per user, shared by every run of the
    machine: another test or soak running beside this one has its live workers' files there), and temporary
    checkpoint directories of Orbax under the run directory."""
    found = []
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        cmdline = _cmdline(int(pid))
        if cmdline is not None and int(pid) != me and any(n in cmdline for n in needles):
            found.append(f"process {pid}: {cmdline[:160]}")
    with open("/proc/mounts") as f:
        found += [f"mount {line.split()[1]}" for line in f if any(line.split()[1].startswith(n) for n in needles)]
    netns = Path("/run/netns")
    if netns.is_dir():
        found += [f"namespace {ns}" for ns in namespaces if (netns / ns).exists()]
    for d in shm_dirs:
        if d.exists():
            found += [f"snapshot file {p}" for p in d.rglob("*") if p.is_file()] or [f"snapshot directory {d}"]
    pids = Path.home() / ".cache" / "reve_jax" / "pids"
    if pids.is_dir():
        for p in sorted(pids.iterdir()):
            if p.name in pid_files:
                continue
            try:
                owner = _cmdline(int(p.read_text().strip()))
            except (OSError, ValueError):
                owner = None  # gone, or not a pid: a file nobody will remove
            if owner is None or any(n in owner for n in needles):
                found.append(f"pid file {p}")
    for n in needles:
        ckpt = Path(n) / "checkpoints"
        if ckpt.is_dir():
            found += [f"temporary checkpoint {p}" for p in ckpt.iterdir() if "tmp" in p.name]
    return found


def _cmdline(pid: int) -> str | None:
    """The command line of live process `pid` (arguments joined by spaces), or None when there is none."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace") if raw else None

"""Host-side costs of a train step, measured without the model: how fast the input pipeline builds batches, and
how long a checkpoint save blocks the caller (plain, or staged behind the next step).

    python scripts/bench_host.py input --preset dit-b2 --batch 64 [--config.data.worker_threads=4 ...]
    python scripts/bench_host.py ckpt --gb 2 [--leaves 64]

Each prints a Markdown table row by row; `--out DIR` appends the rows to DIR/host.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from reve_jax import checkpoint, cli, config
from reve_jax.data import pipeline
from reve_jax.tools.bench import throughput


def input_rate(cfg, batches: int, repeats: int) -> dict:
    """Images/s of this process's batches from the real Grain pipeline of `cfg` (after 2 warm-up batches):
    the median over `repeats` runs of `batches` batches, and every run's rate."""
    b = cfg.train.global_batch
    it = pipeline.make_batch_iterator(cfg.data, cfg.text.max_len, b, 0, 1, 0, text_cfg=cfg.text)
    try:
        for _ in range(2):
            next(it)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            rates.append(batches * b / (time.perf_counter() - t0))
    finally:
        getattr(it, "close", lambda: None)()
    d = cfg.data
    return {
        "what": "input",
        "image_size": d.image_size,
        "batch": b,
        "threads": d.worker_threads,
        "processes": d.worker_processes,
        "images_per_s": statistics.median(rates),
        "runs": rates,
    }


def save_blocking(gb: float, leaves: int, staged: bool) -> dict:
    """Seconds a save of a `gb` GB float32 state (`leaves` equal arrays) keeps the caller waiting, and seconds
    until its files are complete, for `Checkpointer.save` or `stage` + `commit`."""
    n = max(1, int(gb * 1e9 / 4 / leaves))
    state = {f"w{i:03d}": jnp.full((n,), float(i), jnp.float32) for i in range(leaves)}
    jax.block_until_ready(state)
    root = tempfile.mkdtemp(prefix="reve_bench_host_")
    ckpt = checkpoint.Checkpointer(root, async_save=True)
    try:
        t0 = time.perf_counter()
        if staged:
            ckpt.stage(1, state, {})
            t_stage = time.perf_counter() - t0
            ckpt.commit()
        else:
            ckpt.save(1, state, {})
            t_stage = 0.0
        blocking = time.perf_counter() - t0
        ckpt.wait()
        total = time.perf_counter() - t0
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "what": "ckpt staged" if staged else "ckpt",
        "gb": n * leaves * 4 / 1e9,
        "leaves": leaves,
        "blocking_s": blocking,
        "stage_s": t_stage,
        "total_s": total,
        "device": jax.devices()[0].device_kind,
    }


def _print(row: dict, json_path: str | None) -> None:
    if row["what"] == "input":
        print(
            f"| input | {row['image_size']} px | batch {row['batch']} | threads {row['threads']} | "
            f"processes {row['processes']} | {row['images_per_s']:,.0f} img/s |",
            flush=True,
        )
    else:
        print(
            f"| {row['what']} | {row['gb']:.2f} GB in {row['leaves']} arrays | blocking {row['blocking_s']:.3f} s "
            f"(stage {row['stage_s']:.3f} s) | files complete {row['total_s']:.2f} s | {row['device']} |",
            flush=True,
        )
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("input", "ckpt"))
    p.add_argument("--preset", default="dit-b2", choices=throughput.presets(), help="input: the data config")
    p.add_argument("--config", default=None, help="input: a config file instead of a preset")
    p.add_argument("--batch", type=int, default=64, help="input: images per batch")
    p.add_argument("--batches", type=int, default=8, help="input: batches per timed run")
    p.add_argument("--repeats", type=int, default=5, help="input: timed runs (the median is reported)")
    p.add_argument("--gb", type=float, default=1.0, help="ckpt: state size in GB")
    p.add_argument("--leaves", type=int, default=64, help="ckpt: arrays in the state")
    p.add_argument("--out", default=None, help="append the rows to OUT/host.jsonl")
    p.add_argument("--dry-run", action="store_true", help="check the options and the config, then exit")
    args, overrides = cli.parse_args(p, argv)
    rows = []
    if args.what == "input":
        try:
            cfg = throughput.load_bench_config(args.preset, args.config, args.batch, False, overrides)
        except config.ConfigError as e:
            raise SystemExit(f"config error: {e}") from None
        if args.dry_run:
            cli.check_inputs_or_exit(cfg)
            d = cfg.data
            cli.dry_run_exit(
                f"would time {args.repeats} x {args.batches} batches of {args.batch} {d.image_size} px images from "
                f"the {d.name} data of {args.config or args.preset} ({d.worker_threads} threads, "
                f"{d.worker_processes} processes)"
            )
        rows.append(input_rate(cfg, args.batches, args.repeats))
    else:
        if args.dry_run:
            cli.dry_run_exit(f"would time plain and staged saves of a {args.gb:g} GB state in {args.leaves} arrays")
        rows += [save_blocking(args.gb, args.leaves, staged) for staged in (False, True)]
    for row in rows:
        _print(row, Path(args.out) / "host.jsonl" if args.out else None)
    return rows

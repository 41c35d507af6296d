"""Throughput benchmark of the one train step: images/s, executed TFLOP/s, MFU, compile time, peak memory, and the
share of the loop spent waiting for data and for a checkpoint save; optionally beside the reference PyTorch DiT.

    python scripts/bench_throughput.py --preset dit-xl2 --batch 256 --tread both --peer [--config.model.remat=block]

Stages: Config -> Peer (a child process, before JAX claims the GPU) -> State -> AOT compile -> Timed steps ->
Data loop (the real Grain pipeline) -> Checkpoint loop (an async save in the middle) -> Table.
docs/performance.md holds the measured tables and what each change did.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

from reve_jax import batch as batch_lib
from reve_jax import checkpoint, cli, config, flops
from reve_jax.model import layers
from reve_jax.tools.bench.peer import attention_check, run_peer
from reve_jax.train import builder, hooks, loop
from reve_jax.xla import enable_compile_cache

log = logging.getLogger("reve_jax.tools.bench")
REPO = Path(__file__).resolve().parents[3]
GIB = 2**30


# ---------------------------------------------------------------------------------------------------- Presets
PRESET_DIR = REPO / "configs" / "bench"  # --preset dit-xl2 is configs/bench/dit_xl2.py


def presets() -> list[str]:
    return sorted(p.stem.replace("_", "-") for p in PRESET_DIR.glob("*.py") if p.stem not in ("__init__", "shared"))


def preset_path(preset: str) -> Path:
    path = PRESET_DIR / f"{preset.replace('-', '_')}.py"
    if not path.is_file():
        raise config.ConfigError(f"unknown preset {preset!r}: {path} does not exist; presets: {', '.join(presets())}")
    return path


def load_bench_config(preset: str | None, config_path: str | None, batch: int | None, tread: bool, overrides=()):
    """The run config: a preset (configs/bench/<preset>.py) or a config file, with `overrides` (`--config.a.b=v`
    strings), then the batch (when given) and the TREAD switch. Returns a validated, locked ConfigDict."""
    path = config_path or str(preset_path(preset))
    items = [*overrides, f"model.route.enabled={tread}"]
    if batch:
        items.append(f"train.global_batch={batch}")
    return config.load_config(path, items)


class _Collect(logging.Handler):
    """Keeps the messages logged while it is attached (the attention fallback warns while tracing)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def dry_run(args, cfgs) -> None:
    """--dry-run: check each config's inputs, mesh and batch split, print what would run and exit 0."""
    for cfg in cfgs:
        cli.check_inputs_or_exit(cfg)
        mesh = cli.check_mesh_or_exit(cfg)
    peer = ""
    if args.peer:
        found = (Path(args.peer_ref) / "models.py").is_file()
        peer = f", beside the PyTorch DiT from {args.peer_ref}/models.py ({'found' if found else 'missing'})"
    timing = "compile only" if args.compile_only else f"{args.warmup} + {args.repeats} x {args.steps} steps"
    cli.dry_run_exit(
        f"would benchmark {args.config or args.preset} with TREAD {args.tread} at batch "
        f"{cfgs[0].train.global_batch} on mesh {cli.describe_mesh(mesh)}: {timing}{peer}"
    )


# ---------------------------------------------------------------------------------------------------- Ours
def _compile(run: builder.Run) -> tuple[builder.Compiled, list[str]]:
    """The trainer's compiled step for `run` (from abstract shapes) and the attention fallback's warnings."""
    collect = _Collect()
    layers.log.addHandler(collect)
    try:
        return run.compile(), collect.messages
    finally:
        layers.log.removeHandler(collect)


def _device_peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _run(run, state, batch, n: int):
    for _ in range(n):
        state, m = run.step(state, batch)
    return state, m


def _time_steps(run, state, batch, warmup: int, steps: int, repeats: int):
    """Median seconds per step over `repeats` runs of `steps` back-to-back steps, after `warmup` steps. Returns
    (state, median, per-repeat times, last loss)."""
    state, m = _run(run, state, batch, max(warmup, 1))
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = _run(run, state, batch, steps)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / steps)
    return state, statistics.median(times), times, float(m["loss"])


class _Tally:
    """A hook that keeps the loop's input wait (the trainer's own accounting, loop.Context.data_wait_s)."""

    timed = True

    def __init__(self):
        self.data_wait_s = 0.0

    def due(self, ctx) -> bool:
        return ctx.last

    def __call__(self, ctx):
        self.data_wait_s = ctx.data_wait_s


def _data_loop(run, state, steps: int):
    """`steps` steps of the trainer's loop fed by the real Grain pipeline; returns (state, seconds blocked in the
    input, loop seconds). The first step and the first batch are outside the measurement, as in a long run. The
    pipeline's prefetch threads are stopped before returning: left running, they hold the GIL through the rows and
    loops after this one (a checkpoint save's commit thread once waited past the row's cap behind them)."""
    host = run.host_batches(0)
    try:
        batches = map(run.to_device, host)
        state, _ = run.step(state, next(batches))
        jax.block_until_ready(state)
        tally = _Tally()
        t0 = time.perf_counter()
        result = loop.run_loop(run, state, batches, 1, steps + 1, [tally])
        return result.state, tally.data_wait_s, time.perf_counter() - t0
    finally:
        getattr(host, "close", lambda: None)()


class _SaveAt(hooks.CheckpointHook):
    """The trainer's checkpoint hook, firing at one step only."""

    def __init__(self, cfg, ckpt, step: int):
        super().__init__(cfg, ckpt)
        self.at = step

    def due(self, ctx) -> bool:
        return ctx.step == self.at


def _checkpoint_loop(run, state, batch, steps: int, step_s: float, directory: str | None, staged: bool):
    """`steps` steps of the trainer's loop with its checkpoint hook saving after the middle one (`staged`: as
    with train.ckpt_overlap, the device-to-host copy behind the next step). Returns (state, dict): `block_s` the
    loop's time beyond `steps * step_s`, `finish_s` the wait for the background write after the loop."""
    cfg = copy.deepcopy(run.cfg)
    config.apply_override(cfg, f"train.ckpt_overlap={staged}")
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="reve_bench_ckpt_"))
    ckpt = checkpoint.Checkpointer(root / "run", keep=1, async_save=True)
    try:
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        result = loop.run_loop(run, state, itertools.repeat(batch), 0, steps, [_SaveAt(cfg, ckpt, steps // 2)])
        loop_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ckpt.wait()
        finish = time.perf_counter() - t0
    finally:
        ckpt.close()
        shutil.rmtree(root / "run", ignore_errors=True)
        if not directory:
            shutil.rmtree(root, ignore_errors=True)
    return result.state, {"block_s": max(0.0, loop_s - steps * step_s), "finish_s": finish}


def bench_jax(cfg, opts, *, fresh_process: bool) -> dict:
    """Build the trainer's run of `cfg` (builder.build), compile its step from abstract shapes, then create the
    state and time it; returns one result row (see `format_table`).

    `opts` carries warmup/steps/repeats/data_steps/ckpt/ckpt_dir/compile_only. `fresh_process` says no earlier
    row ran in this process, so the device's peak-memory counter belongs to this row alone."""
    run = builder.build(cfg)
    m = cfg.model
    attention = layers.attention_impl(m.attention, m.dtype, m.width // m.heads)
    try:
        compiled, fallback = _compile(run)
    except Exception as e:  # cuDNN can also refuse at compile time; 'auto' then means XLA
        if attention != "cudnn" or m.attention != "auto":
            raise
        log.warning("compiling with cuDNN attention failed (%s: %s); retrying with XLA attention", type(e).__name__, e)
        cfg = copy.deepcopy(cfg)
        config.apply_override(cfg, "model.attention='xla'")
        return dict(bench_jax(cfg, opts, fresh_process=fresh_process), attention="xla (cudnn compile failed)")
    mem = compiled.memory()
    log.info(
        "compiled in %.1fs; memory_analysis GiB: %s",
        compiled.seconds,
        ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.items()),
    )
    b = cfg.train.global_batch
    row = {
        "model": opts.name,
        "impl": "reve_jax" + (f" {opts.label}" if opts.label else ""),
        "batch": b,
        "tread": m.route.enabled,
        "flops_per_image": flops.train_flops_per_image(cfg),
        "compile_s": compiled.seconds,  # trace, lower and compile
        "lower_s": compiled.lower_seconds,  # the Python trace and lowering part of compile_s
        "memory": mem,
        "attention": "xla (cudnn refused)" if fallback else attention,
        "dtype": m.dtype,
        "remat": m.remat,
    }
    if mem:
        row["peak_bytes"], row["peak_mem_source"] = mem["estimate"], "xla"
    if opts.compile_only:
        return row
    state = run.init_state()
    batch = run.to_device(batch_lib.random(cfg))
    state, step_s, times, loss = _time_steps(run, state, batch, opts.warmup, opts.steps, opts.repeats)
    row.update(step_s=step_s, step_times=times, images_per_s=b / step_s, loss=loss)
    peak = _device_peak_bytes()
    if peak is not None and fresh_process:
        row["peak_bytes"], row["peak_mem_source"] = peak, "device"
    if opts.data_steps > 0:
        state, wait, total = _data_loop(run, state, opts.data_steps)
        row.update(data_wait_s=wait, data_loop_s=total, data_wait_frac=wait / total)
    if opts.ckpt:
        n = max(opts.steps, 3)
        state, ck = _checkpoint_loop(run, state, batch, n, step_s, opts.ckpt_dir, staged=opts.ckpt == "staged")
        row.update({f"ckpt_{k}": v for k, v in ck.items()}, ckpt_mode=opts.ckpt)
    del state
    return row


# ---------------------------------------------------------------------------------------------------- Table
COLUMNS = (
    "model",
    "impl",
    "batch",
    "tread",
    "img/s",
    "step ms",
    "TFLOP/s",
    "MFU",
    "compile s",
    "peak GiB",
    "data wait",
    "ckpt block s",
)


def _cells(row: dict) -> list[str]:
    if "error" in row:
        return [row["model"], row["impl"], str(row["batch"]), "on" if row["tread"] else "off"] + [
            "error" if i == 0 else "-" for i in range(len(COLUMNS) - 4)
        ]
    peak = row.get("peak_bytes")
    peak_txt = "-" if peak is None else f"{peak / GIB:.1f}" + ("" if row.get("peak_mem_source") == "device" else "*")
    if "images_per_s" not in row:  # compiled only
        rate = ["-"] * 4
    else:
        rate = [
            f"{row['images_per_s']:,.0f}" if row["images_per_s"] >= 10 else f"{row['images_per_s']:.2f}",
            f"{row['step_s'] * 1e3:.1f}",
            f"{row['tflops']:.1f}" if row["tflops"] >= 1 else f"{row['tflops']:.3f}",
            f"{100 * row['mfu']:.1f}%",
        ]
    return [
        row["model"],
        row["impl"],
        str(row["batch"]),
        "on" if row["tread"] else "off",
        *rate,
        f"{row['compile_s']:.1f}",
        peak_txt,
        f"{100 * row['data_wait_frac']:.1f}%" if "data_wait_frac" in row else "-",
        f"{row['ckpt_block_s']:.2f}" if "ckpt_block_s" in row else "-",
    ]


def add_rates(row: dict, peak_tflops: float, num_devices: int) -> dict:
    """Add TFLOP/s and MFU (against `peak_tflops` per device) to a timed row."""
    if "error" in row or "images_per_s" not in row:
        return row
    tflops = row["flops_per_image"] * row["images_per_s"] / 1e12
    return dict(row, tflops=tflops, mfu=tflops / (peak_tflops * num_devices))


def format_table(rows: list[dict]) -> str:
    """A Markdown table of result rows (COLUMNS). `*` marks a peak-memory figure from XLA's memory analysis
    (arguments + outputs - donated + temporaries) instead of the device's own counter."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- Entry point
def parse_args(argv=None):
    """Benchmark options; `--config.a.b=v` overrides come back in the second element."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--preset", default="dit-b2", choices=presets(), help="configs/bench/<preset>.py (or --config)")
    p.add_argument("--config", default=None, help="a config file instead of a preset")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the preset's)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; the median step time is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.add_argument("--tread", default="off", choices=("on", "off", "both"), help="TREAD token routing")
    p.add_argument("--data-steps", type=int, default=5, help="steps fed by the real Grain pipeline (0: skip)")
    p.add_argument(
        "--ckpt",
        default="on",
        choices=("on", "off", "staged"),
        help="time an async checkpoint save in a loop (staged: behind the next step, as train.ckpt_overlap)",
    )
    p.add_argument("--ckpt-dir", default=None, help="where the benchmark checkpoint goes (default: a temp dir)")
    p.add_argument("--peer", action="store_true", help="also time the reference PyTorch DiT (needs .ref/models.py)")
    p.add_argument("--peer-ref", default=str(REPO / ".ref"), help="folder holding the reference DiT's models.py")
    p.add_argument("--peer-compile", default="auto", choices=("auto", "on", "off"), help="torch.compile (auto: GPU)")
    p.add_argument("--peer-timeout", type=int, default=900, help="seconds before the peer is given up")
    p.add_argument("--label", default="", help="a tag for the rows of this run (e.g. the XLA flags tried)")
    p.add_argument("--out", default=None, help="append every row as a JSON line to OUT/results.jsonl")
    p.add_argument("--check-attention", action="store_true", help="compare cuDNN and XLA attention first")
    p.add_argument("--compile-only", action="store_true", help="compile from shapes and report memory, no timing")
    p.add_argument("--ours", default="on", choices=("on", "off"), help="time reve_jax (off: the peer alone)")
    p.add_argument("--table-from", default=None, help="only print the table of the rows an --out directory holds")
    p.add_argument("--dry-run", action="store_true", help="check the configs, inputs and mesh, then exit")
    return cli.parse_args(p, argv)


def _results(out: str) -> Path:
    """The rows file of an --out directory (a path ending in .jsonl names the file itself)."""
    return Path(out) if out.endswith(".jsonl") else Path(out) / "results.jsonl"


def _cuda_visible() -> bool:
    """Whether a CUDA GPU is present, without initialising JAX's GPU backend (the peer must run first)."""
    return shutil.which("nvidia-smi") is not None and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")


def main(argv=None) -> list[dict]:
    """Run the benchmark; print the table last and return the rows. With --out each row is appended as soon as it
    is measured, so a run cut short keeps what it finished. The persistent compilation cache is the config's
    (`--config.train.compile_cache=DIR`)."""
    args, overrides = parse_args(argv)
    if args.table_from:
        rows = [json.loads(ln) for ln in _results(args.table_from).read_text().splitlines() if ln.strip()]
        devices = sorted({f"{r['device']} x{r['devices']}, jax {r['jax']}" for r in rows})
        print("\n" + "; ".join(devices))
        print(format_table(rows), flush=True)
        return rows
    cli.setup_logging()
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    treads = {"on": [True], "off": [False], "both": [False, True]}[args.tread]
    try:
        cfgs = [load_bench_config(args.preset, args.config, args.batch, t, overrides) for t in treads]
    except config.ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    if args.dry_run:
        dry_run(args, cfgs)
    cache = cfgs[0].train.compile_cache
    if cache:
        enable_compile_cache(cache)
    opts = argparse.Namespace(
        name="config" if args.config else args.preset,
        label=args.label,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        data_steps=args.data_steps,
        ckpt=None if args.ckpt == "off" else args.ckpt,
        ckpt_dir=args.ckpt_dir,
        compile_only=args.compile_only,
        peer_ref=args.peer_ref,
        peer_compile=args.peer_compile == "on" or (args.peer_compile == "auto" and _cuda_visible()),
        peer_timeout=args.peer_timeout,
    )
    peer_row = run_peer(cfgs[0], opts) if args.peer else None  # before JAX claims the GPU's memory
    if peer_row and "error" in peer_row:
        log.error("peer failed: %s", peer_row["error"])
    peak, source = flops.peak_tflops(cfgs[0].train.peak_tflops)
    meta = {
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "peak_tflops": peak,
        "peak_tflops_source": source,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "overrides": overrides,
    }
    rows = []

    def record(row):
        rows.append(add_rates(row, peak, jax.device_count()))
        if args.out:
            _results(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(_results(args.out), "a") as f:
                f.write(json.dumps(dict(meta, **rows[-1])) + "\n")

    if peer_row:
        record(peer_row)
    if args.check_attention:
        try:
            log.info("attention check: %s", attention_check())
        except Exception as e:  # no cuDNN here (CPU): the check is informative only
            log.warning("attention check not run: %s: %s", type(e).__name__, str(e)[:300])
    for i, cfg in enumerate(cfgs if args.ours == "on" else []):
        record(bench_jax(cfg, opts, fresh_process=i == 0))
    print(f"\n{meta['device']} x{meta['devices']}, jax {meta['jax']}, peak {peak:.1f} TFLOP/s ({source})")
    print(format_table(rows), flush=True)
    if any(not math.isfinite(r.get("loss", 0.0)) for r in rows):
        log.error("a timed step produced a non-finite loss")
    return rows


if __name__ == "__main__":
    main()

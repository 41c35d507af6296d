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
import dataclasses
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
import numpy as np

from reve_jax import checkpoint, config, flops, metrics, sharding, train_state
from reve_jax.bench.peer import attention_check, run_peer
from reve_jax.data import pipeline, tokenizer
from reve_jax.model import layers
from reve_jax.xla import enable_compile_cache

log = logging.getLogger("reve_jax.bench")
REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


# ---------------------------------------------------------------------------------------------------- Presets
@dataclasses.dataclass(frozen=True)
class Preset:
    """A config file (relative to the repo) with overrides, and the batch the benchmark uses by default."""

    config: str
    overrides: tuple[str, ...]
    batch: int


# DiT's latent 32x32 grid at patch 2 is 256 tokens; in pixel space that is 256 px at patch 16. A plain linear patch
# embedding (bottleneck 0) and a GELU-equivalent SwiGLU (mlp_ratio 4) match DiT's block FLOPs. One-object captions
# (13 tokens, max_len 16) keep the text tokens that ride along in every block to 6% of the sequence. TREAD routes
# blocks [2, depth-2), as the plain JAX reference step in RECIPE.md section 8 did.
_DIT = (
    "model.patch=16",
    "model.bottleneck=0",
    "model.mlp_ratio=4.0",
    "model.rope_theta=10000.0",
    "data.image_size=256",
    "data.max_objects=1",
    "text.max_len=16",
    "model.route.start=2",
    "model.route.end=-2",
)
PRESETS = {
    "dit-b2": Preset("configs/base.py", _DIT + ("model.width=768", "model.depth=12", "model.heads=12"), 256),
    "dit-xl2": Preset("configs/base.py", _DIT + ("model.width=1152", "model.depth=28", "model.heads=16"), 256),
    # Photoroom routes blocks 2..12 of 16 (RECIPE.md section 3).
    "prx-1b": Preset("configs/prx_1b.py", ("model.route.start=2", "model.route.end=-4"), 128),
    # CPU smoke test: compiles in seconds.
    "tiny": Preset(
        "configs/tiny.py",
        (
            "model.width=32",
            "model.depth=3",
            "model.heads=2",
            "model.patch=4",
            "model.bottleneck=0",
            "model.route.start=1",
            "model.route.end=-1",
            "text.width=32",
            "text.depth=1",
            "text.heads=2",
            "text.max_len=16",
            "data.image_size=16",
            "data.max_objects=1",
            "data.worker_threads=0",
        ),
        8,
    ),
}


def load_bench_config(preset: str | None, config_path: str | None, batch: int | None, tread: bool, overrides=()):
    """The run config: a preset (or a config file) with `overrides` (`--config.a.b=v` strings), then the batch and
    TREAD switch applied last. Returns a validated, locked ConfigDict."""
    if config_path:
        path, extra, default_batch = config_path, (), None
    else:
        p = PRESETS[preset]
        path, extra, default_batch = str(REPO / p.config), p.overrides, p.batch
    items = [*extra, *overrides, f"model.route.enabled={tread}"]
    if batch or default_batch:
        items.append(f"train.global_batch={batch or default_batch}")
    return config.load_config(path, items)


# ---------------------------------------------------------------------------------------------------- Inputs
def random_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """A host batch with the shapes and dtypes of the pipeline's (random content: never time zeros)."""
    rng = np.random.default_rng(seed)
    b, s, L = cfg.train.global_batch, cfg.data.image_size, cfg.text.max_len
    lengths = rng.integers(1, L + 1, b)
    batch = {
        "image": rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
        "text_mask": np.arange(L)[None] < lengths[:, None],
    }
    if cfg.text.encoder == "builtin":
        batch["tokens"] = rng.integers(2, tokenizer.VOCAB_SIZE, (b, L)).astype(np.int32) * batch["text_mask"]
    else:
        batch["text_emb"] = rng.standard_normal((b, L, cfg.text.emb_dim)).astype(np.float32)
    return batch


def _device_batch(local: dict, mesh, global_batch: int) -> dict:
    keys = ("image", "tokens", "text_emb", "text_mask")
    return sharding.global_batch_from_local({k: v for k, v in local.items() if k in keys}, mesh, global_batch)


class _Collect(logging.Handler):
    """Keeps the messages logged while it is attached (the attention fallback warns while tracing)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# ---------------------------------------------------------------------------------------------------- Ours
def _compile(setup, state, batch):
    """AOT-compile the jitted step for `state` and `batch` (arrays or ShapeDtypeStructs with shardings). Returns
    (step, compiled, (trace-and-lower seconds, total seconds), the attention fallback's warnings):
    `step(state, batch) -> (state, metrics)` runs the compiled program with the frozen perceptual networks
    (`setup.frozen.states`, where the setup has them) bound."""
    frozen = getattr(setup, "frozen", None)
    extra = (frozen.states,) if frozen is not None else ()
    step_fn = train_state.jit_train_step(setup, jax.tree.map(lambda a: a.sharding, batch))
    collect = _Collect()
    layers.log.addHandler(collect)
    try:
        t0 = time.perf_counter()
        with jax.set_mesh(setup.mesh):
            lowered = step_fn.lower(state, batch, *extra)
            lower_s = time.perf_counter() - t0
            compiled = lowered.compile()
        seconds = (lower_s, time.perf_counter() - t0)
    finally:
        layers.log.removeHandler(collect)

    def step(state, batch):
        return compiled(state, batch, *extra)

    return step, compiled, seconds, collect.messages


def _memory(compiled) -> dict:
    """memory_analysis() in bytes, with `estimate` = arguments + outputs - aliased (donated) + temporaries."""
    mem = compiled.memory_analysis()
    if mem is None:
        return {}
    out = {
        k: int(getattr(mem, f"{k}_size_in_bytes"))
        for k in ("argument", "output", "alias", "temp", "generated_code")
        if hasattr(mem, f"{k}_size_in_bytes")
    }
    out["estimate"] = out.get("argument", 0) + out.get("output", 0) - out.get("alias", 0) + out.get("temp", 0)
    return out


def _device_peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _run(step, state, batch, n: int, mesh):
    with jax.set_mesh(mesh):
        for _ in range(n):
            state, m = step(state, batch)
    return state, m


def _time_steps(step, state, batch, mesh, warmup: int, steps: int, repeats: int):
    """Median seconds per step over `repeats` runs of `steps` back-to-back steps, after `warmup` steps. Returns
    (state, median, per-repeat times, last loss)."""
    state, m = _run(step, state, batch, max(warmup, 1), mesh)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = _run(step, state, batch, steps, mesh)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / steps)
    return state, statistics.median(times), times, float(m["loss"])


def _data_loop(cfg, step, state, mesh, steps: int):
    """Run `steps` steps fed by the real Grain pipeline; returns (state, seconds blocked in the input, loop seconds).
    One step is in flight before the loop, as in the trainer, so a fetch overlaps the previous step."""
    b = cfg.train.global_batch
    it = pipeline.make_batch_iterator(cfg.data, cfg.text.max_len, b, jax.process_index(), jax.process_count(), 0)
    with jax.set_mesh(mesh):
        state, _ = step(state, _device_batch(next(it), mesh, b))
        wait, t_start = 0.0, time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = _device_batch(next(it), mesh, b)
            wait += time.perf_counter() - t0
            state, _ = step(state, batch)
    jax.block_until_ready(state)
    return state, wait, time.perf_counter() - t_start


def _checkpoint_loop(step, state, batch, mesh, steps: int, step_s: float, directory: str | None, staged: bool):
    """Run `steps` steps with an async save of the state after the middle one (`staged`: as the trainer does with
    train.ckpt_overlap, stage it there and commit after dispatching the next step). Returns (state, dict):
    `block_s` the loop's time beyond `steps * step_s`, `save_call_s` the time inside save() (or stage() + commit()),
    `finish_s` the wait for the background write after the loop."""
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="reve_bench_ckpt_"))
    ckpt = checkpoint.Checkpointer(root / "run", keep=1, async_save=True)
    try:
        jax.block_until_ready(state)
        t_start = time.perf_counter()
        save_call = 0.0
        with jax.set_mesh(mesh):
            for i in range(steps):
                state, _ = step(state, batch)
                if staged and i == steps // 2 + 1:
                    t0 = time.perf_counter()
                    ckpt.commit()
                    save_call += time.perf_counter() - t0
                if i == steps // 2:
                    t0 = time.perf_counter()
                    (ckpt.stage if staged else ckpt.save)(1, state, {"bench": True})
                    save_call += time.perf_counter() - t0
        jax.block_until_ready(state)
        loop = time.perf_counter() - t_start
        t0 = time.perf_counter()
        ckpt.wait()
        finish = time.perf_counter() - t0
    finally:
        ckpt.close()
        shutil.rmtree(root / "run", ignore_errors=True)
        if not directory:
            shutil.rmtree(root, ignore_errors=True)
    return state, {"block_s": max(0.0, loop - steps * step_s), "save_call_s": save_call, "finish_s": finish}


def bench_jax(cfg, opts, *, fresh_process: bool) -> dict:
    """Compile the train step of `cfg` from abstract shapes, then build the state and time it; returns one result
    row (see `format_table`).

    `opts` carries warmup/steps/repeats/data_steps/ckpt/ckpt_dir/compile_only. `fresh_process` says no earlier
    row ran in this process, so the device's peak-memory counter belongs to this row alone."""
    mesh = sharding.make_mesh(cfg.mesh)
    setup = train_state.make_setup(cfg, mesh)
    b, m = cfg.train.global_batch, cfg.model
    host = random_batch(cfg)
    abstract_batch = {
        k: jax.ShapeDtypeStruct((b,) + v.shape[1:], v.dtype, sharding=sharding.batch_sharding(mesh, v.ndim))
        for k, v in host.items()
    }
    attention = layers.attention_impl(m.attention, m.dtype, m.width // m.heads)
    try:
        step, compiled, (lower_s, compile_s), fallback = _compile(setup, setup.abstract_state, abstract_batch)
    except Exception as e:  # cuDNN can also refuse at compile time; 'auto' then means XLA
        if attention != "cudnn" or m.attention != "auto":
            raise
        log.warning("compiling with cuDNN attention failed (%s: %s); retrying with XLA attention", type(e).__name__, e)
        cfg = copy.deepcopy(cfg)
        config.apply_override(cfg, "model.attention='xla'")
        return dict(bench_jax(cfg, opts, fresh_process=fresh_process), attention="xla (cudnn compile failed)")
    mem = _memory(compiled)
    log.info(
        "compiled in %.1fs; memory_analysis GiB: %s", compile_s, ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.items())
    )
    row = {
        "model": opts.name,
        "impl": "reve_jax" + (f" {opts.label}" if opts.label else ""),
        "batch": b,
        "tread": m.route.enabled,
        "flops_per_image": flops.train_flops_per_image(cfg),
        "compile_s": compile_s,  # trace, lower and compile
        "lower_s": lower_s,  # the Python trace and lowering part of compile_s
        "memory": mem,
        "attention": "xla (cudnn refused)" if fallback else attention,
        "dtype": m.dtype,
        "remat": m.remat,
    }
    if mem:
        row["peak_bytes"], row["peak_mem_source"] = mem["estimate"], "xla"
    if opts.compile_only:
        return row
    state = train_state.init_state(setup)
    batch = _device_batch(host, mesh, b)
    state, step_s, times, loss = _time_steps(step, state, batch, mesh, opts.warmup, opts.steps, opts.repeats)
    row.update(step_s=step_s, step_times=times, images_per_s=b / step_s, loss=loss)
    peak = _device_peak_bytes()
    if peak is not None and fresh_process:
        row["peak_bytes"], row["peak_mem_source"] = peak, "device"
    if opts.data_steps > 0:
        state, wait, total = _data_loop(cfg, step, state, mesh, opts.data_steps)
        row.update(data_wait_s=wait, data_loop_s=total, data_wait_frac=wait / total)
    if opts.ckpt:
        n = max(opts.steps, 3)
        state, ck = _checkpoint_loop(step, state, batch, mesh, n, step_s, opts.ckpt_dir, staged=opts.ckpt == "staged")
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
    p.add_argument("--preset", default="dit-b2", choices=sorted(PRESETS), help="model size (ignored with --config)")
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
    p.add_argument(
        "--compile-cache", default=None, help="persistent compilation cache dir (default train.compile_cache)"
    )
    p.add_argument("--peer", action="store_true", help="also time the reference PyTorch DiT (needs .ref/models.py)")
    p.add_argument("--peer-ref", default=str(REPO / ".ref"), help="folder holding the reference DiT's models.py")
    p.add_argument("--peer-compile", default="auto", choices=("auto", "on", "off"), help="torch.compile (auto: GPU)")
    p.add_argument("--peer-timeout", type=int, default=900, help="seconds before the peer is given up")
    p.add_argument("--label", default="", help="a tag for the rows of this run (e.g. the XLA flags tried)")
    p.add_argument("--json", default=None, help="append every row as a JSON line to this file")
    p.add_argument("--check-attention", action="store_true", help="compare cuDNN and XLA attention first")
    p.add_argument("--compile-only", action="store_true", help="compile from shapes and report memory, no timing")
    p.add_argument("--ours", default="on", choices=("on", "off"), help="time reve_jax (off: the peer alone)")
    p.add_argument("--table-from", default=None, help="only print the table of the rows in this JSON-lines file")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        p.error(f"unrecognised arguments {bad}; config overrides look like --config.model.depth=4")
    return args, overrides


def _cuda_visible() -> bool:
    """Whether a CUDA GPU is present, without initialising JAX's GPU backend (the peer must run first)."""
    return shutil.which("nvidia-smi") is not None and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")


def main(argv=None) -> list[dict]:
    """Run the benchmark; print the table last and return the rows. With --json each row is appended as soon as it
    is measured, so a run cut short keeps what it finished."""
    args, overrides = parse_args(argv)
    if args.table_from:
        rows = [json.loads(ln) for ln in Path(args.table_from).read_text().splitlines() if ln.strip()]
        devices = sorted({f"{r['device']} x{r['devices']}, jax {r['jax']}" for r in rows})
        print("\n" + "; ".join(devices))
        print(format_table(rows), flush=True)
        return rows
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    treads = {"on": [True], "off": [False], "both": [False, True]}[args.tread]
    cfgs = [load_bench_config(args.preset, args.config, args.batch, t, overrides) for t in treads]
    cache = args.compile_cache or cfgs[0].train.compile_cache
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
    peak, source = metrics.peak_tflops(cfgs[0].train.peak_tflops)
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
        if args.json:
            with open(args.json, "a") as f:
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

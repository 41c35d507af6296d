"""Metrics out of the loop: metrics.jsonl (one JSON object per logged step) and TensorBoard, process 0 only;
and the device peak used for MFU."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense bf16 peak per chip, for MFU. A device kind not listed here uses train.peak_tflops or a measured peak.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


class MetricsWriter:
    """Appends to `<workdir>/metrics.jsonl` and TensorBoard event files under `<workdir>/tb`."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(Path(workdir) / "tb"))
            except ImportError:  # TensorBoard is optional; metrics.jsonl is the record
                self._tb = None

    def write(self, step: int, values: dict):
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time(), **{k: _scalar(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self):
        if self._tb is not None:
            self._tb.close()


def _scalar(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measured_matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    """Achieved float32 matmul TFLOP/s of device 0: the peak used for MFU where no datasheet peak is known."""
    x = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def peak_tflops(configured: float) -> tuple[float, str]:
    """Per-device peak TFLOP/s and where it came from: the config, the datasheet, or a measured matmul."""
    if configured > 0:
        return configured, "config"
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops, f"datasheet {name} bf16"
    return measured_matmul_tflops(), "measured f32 matmul"

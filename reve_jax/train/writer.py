"""The run's metrics out of the loop: metrics.jsonl (one JSON object per logged step) and TensorBoard, process 0
only."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


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

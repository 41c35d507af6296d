"""The events file `<workdir>/events.jsonl`: one JSON object a line for every launch, exit, failure,
quarantine, probe, re-admission, recovery (with its time split) and the finish; and the summary printed at
the end."""

from __future__ import annotations

import json
import os
import time


class EventLog:
    """Appends records to `path`; every record gets `time` (Unix seconds) and `t` (seconds since the log was
    opened, on `clock`). Keeps what this run wrote for the summary."""

    def __init__(self, path: str, clock=time.monotonic):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._clock = clock
        self._t0 = clock()
        self.records: list[dict] = []
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the run; closed by close())

    def write(self, kind: str, data: dict | None = None) -> dict:
        """Appends one record of `kind` with the fields of `data`; returns the record."""
        rec = {"time": round(time.time(), 3), "t": round(self._clock() - self._t0, 3), "event": kind}
        rec.update(data or {})
        self._file.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        return rec

    def close(self) -> None:
        self._file.close()


def read_events(path: str) -> list[dict]:
    """Returns every record of an events file, oldest first; a torn last line (a killed writer) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def summary(records: list[dict]) -> str:
    """Returns a short human-readable account of a run's records."""
    n = lambda kind: sum(r["event"] == kind for r in records)
    lines = [
        f"launches {n('launch')}, failures {n('failure')}, quarantines {n('quarantine')}, "
        f"exclusions {n('exclude')}, re-admissions {n('readmit')}"
    ]
    for r in records:
        if r["event"] == "failure":
            lines.append(
                f"  failure  attempt {r['attempt']} hosts {r['hosts'] or 'group'}: {r['reason']} "
                f"(step {r['step']}, detected after {r['detection_s']:.1f} s)"
            )
        elif r["event"] == "recovery":
            lines.append(
                f"  recovery ({r['cause']}) on {r['group_size']} hosts: detection {r['detection_s']:.1f} s, "
                f"restart {r['restart_s']:.1f} s, restore {r['restore_s']:.1f} s, first step "
                f"{r['first_step_s']:.1f} s, total {r['total_s']:.1f} s; lost {r['lost_steps']} steps "
                f"({r['last_step']} -> {r['restored_step']})"
            )
        elif r["event"] == "finish":
            lines.append(f"finish: {r['status']} ({r['reason']})")
    return "\n".join(lines)

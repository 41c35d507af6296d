"""The chaos soak's short form (scripts/chaos.py; docs/elastic.md has the full soak): the real trainer on 2 namespace
hosts, one SIGKILL, one partition and one SIGTERM-and-restart of the supervisor, each as soon as the group trains
again on both hosts (a kill or a partition leaves a group of one that trains on; the next fault waits for the failed
host's re-admission); then the soak's own checks: the run finished at its last step, every data position was trained
exactly once along the surviving steps, every step's loss is within 2% of an uninterrupted run's, and nothing
(process, namespace, mount, snapshot file, pid file, temporary checkpoint) is left behind. Skipped where no
namespace bed can be made (not root, no iproute2 or sshd)."""

import json
import os
import subprocess
import sys

import pytest

from reve_jax.elastic.testbed import NetnsBed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(bool(NetnsBed.unavailable()), reason=NetnsBed.unavailable() or "available")


def test_short_chaos_soak_kill_partition_and_supervisor_restart(tmp_path):
    report = tmp_path / "report.json"
    argv = [
        sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--hosts", "2",
        "--kinds", "kill,partition,supervisor", "--faults-per-kind", "1", "--steps", "24", "--ckpt-every", "5",
        "--no-settle", "--timeout", "180",
        "--dir", str(tmp_path / "soak"), "--report", str(report),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(done.stdout[-3000:])
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["problems"] == [] and done.returncode == 0, got["problems"]
    assert sorted(r["kind"] for r in got["rows"]) == ["kill", "partition", "supervisor"]
    for r in got["rows"]:
        assert 0 <= r["detect_s"] <= r["again_s"] < 120 and r["lost"] >= 0, r
    supervisor = next(r for r in got["rows"] if r["kind"] == "supervisor")
    assert supervisor["lost"] == 0  # a stop on request saves first
    assert got["loss"]["max_rel"] <= 0.02 and got["leftovers"] == []
    assert not (tmp_path / "soak").exists()  # removed once every check passed

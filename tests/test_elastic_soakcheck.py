"""The chaos soak's leftover check (reve_jax/elastic/soakcheck.py): a pid file counts against the run when its
process is gone (nobody will remove it) or is the run's own, never when it names a live process of another run
sharing the per-user pid directory."""

import subprocess
import sys

from reve_jax.elastic import soakcheck


def test_pid_files_count_when_stale_or_the_runs_own_not_when_another_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    pids = tmp_path / ".cache" / "reve_jax" / "pids"
    pids.mkdir(parents=True)
    run_dir = tmp_path / "soak"
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)])
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "other")])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    try:
        for name, pid in (("before", theirs.pid), ("ours", ours.pid), ("theirs", theirs.pid), ("gone", gone.pid)):
            (pids / f"{name}.pid").write_text(f"{pid}\n")
        (pids / "garbage.pid").write_text("not a pid")
        found = soakcheck.leftovers([str(run_dir)], [], [], {"before.pid"})
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait(timeout=30)
    files = sorted(x.split("/")[-1] for x in found if x.startswith("pid file"))
    assert files == ["garbage.pid", "gone.pid", "ours.pid"], found
    procs = [x.rstrip() for x in found if x.startswith("process")]
    assert procs == [f"process {ours.pid}: {sys.executable} -c import time; time.sleep(60) {run_dir}"], found

"""Fencing (reve_jax/elastic/fence.py): a process of a superseded group exits before it writes to the run
directory, whether the write is an open, a rename or a removal, and the watcher ends a silent one. Each case
runs in a child process: audit hooks last as long as the process."""

import os
import subprocess
import sys
import textwrap
import time

from reve_jax.elastic import fence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import os, shutil, sys, time
    from reve_jax.elastic.fence import Fence
    wd, action = sys.argv[1], sys.argv[2]
    Fence(wd, attempt=3, poll_s=float(sys.argv[3])).install()
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:   # allowed: group 3 owns the run
        f.write("before\\n")
    open(os.path.join(wd, "..", "outside.txt"), "w").write("x")  # outside the run: never fenced
    print("ready", flush=True)
    while not os.path.exists(os.path.join(wd, "go")):
        time.sleep(0.01)
    if action == "append":
        with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
            f.write("after\\n")
    elif action == "rename":
        os.replace(os.path.join(wd, "ckpt.tmp"), os.path.join(wd, "ckpt"))
    elif action == "rmtree":
        shutil.rmtree(os.path.join(wd, "old"))
    elif action == "idle":
        time.sleep(30)
    print("wrote", flush=True)
    """
)


def run_child(tmp_path, action: str, poll_s: float = 30.0, fence_to: int = 4):
    wd = tmp_path / "run"
    (wd / "old").mkdir(parents=True)
    (wd / "ckpt.tmp").write_text("data")
    fence.write_fence(str(wd), 3)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(wd), action, str(poll_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        fence.write_fence(str(wd), fence_to)  # the supervisor gave up on group 3
        (wd / "go").write_text("")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, out, err, wd


def test_superseded_group_cannot_append_rename_or_remove(tmp_path):
    for action in ("append", "rename", "rmtree"):
        code, out, err, wd = run_child(tmp_path / action, action)
        assert code == fence.EXIT_FENCED and "wrote" not in out, (action, out, err)
        assert "superseded" in err
        assert (wd / "metrics.jsonl").read_text() == "before\n"
        assert (wd / "ckpt.tmp").exists() and not (wd / "ckpt").exists()
        assert (wd / "old").is_dir()


def test_current_group_writes_and_a_silent_stale_one_is_ended_by_the_watcher(tmp_path):
    code, out, _, wd = run_child(tmp_path / "ok", "append", fence_to=3)  # the fence did not move past 3
    assert code == 0 and "wrote" in out and (wd / "metrics.jsonl").read_text() == "before\nafter\n"
    t0 = time.monotonic()
    code, out, _, _ = run_child(tmp_path / "idle", "idle", poll_s=0.1)
    assert code == fence.EXIT_FENCED and time.monotonic() - t0 < 10


def test_fence_file_round_trip(tmp_path):
    assert fence.read_fence(str(tmp_path)) == -1
    fence.write_fence(str(tmp_path), 7)
    assert fence.read_fence(str(tmp_path)) == 7
    assert not fence.Fence(str(tmp_path), 7).fenced() and fence.Fence(str(tmp_path), 6).fenced()

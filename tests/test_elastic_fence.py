"""Fencing (reve_jax/elastic/fence.py): a process of a superseded group exits before it writes to the run
directory, whether the write is an open, a rename or a removal, and the watcher ends a silent one. Each case
runs in a child process: audit hooks last as long as the process."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from test_elastic_e2e import events, fake_args, last_metric_step

from reve_jax.elastic import backends, fence
from reve_jax.elastic.policy import PolicyConfig
from reve_jax.elastic.supervisor import Supervisor, WorkerSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import errno, os, shutil, sys, time
    from reve_jax.elastic.fence import Fence
    wd, action = sys.argv[1], sys.argv[2]
    if os.environ.get("FENCE_EACCES"):  # from "go" on, the fence cannot be opened (as on a file system that refuses)
        real_open = os.open
        def refusing_open(path, *a, **kw):
            if str(path).endswith(".fence") and os.path.exists(os.path.join(wd, "go")):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *a, **kw)
        os.open = refusing_open
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


def run_child(tmp_path, action: str, poll_s: float = 30.0, fence_to: int | str = 4, env=None):
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
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        if isinstance(fence_to, str):  # not a number: what a torn or foreign file would hold
            (wd / fence.FENCE_FILE).write_text(fence_to)
        else:
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


def test_a_fence_that_cannot_be_read_refuses_the_write(tmp_path):
    """Finding 7: the fence read failed open (-1, "everyone may write") on any error. Now only a missing fence
    reads as -1; EACCES (or EIO, ESTALE) and a fence that holds no number refuse the write, with the cause."""
    for name, fence_to, env in (("garbage", "\x00\x00", {}), ("eacces", 3, {"FENCE_EACCES": "1"})):
        code, out, err, wd = run_child(tmp_path / name, "append", fence_to=fence_to, env=env)
        assert code != 0 and "wrote" not in out, (name, out, err)
        assert "refusing open" in err and ("not a group number" in err or "Permission denied" in err), err
        assert (wd / "metrics.jsonl").read_text() == "before\n"
        assert fence.Fence(str(wd), 3).fenced() == (name == "garbage")  # EACCES only in the child
    (tmp_path / "bad" / fence.FENCE_FILE).parent.mkdir()
    (tmp_path / "bad" / fence.FENCE_FILE).write_text("x")
    with pytest.raises(fence.FenceUnreadable, match="not a group number"):
        fence.read_fence(str(tmp_path / "bad"))


def test_a_fence_ahead_of_the_events_file_numbers_the_next_group_past_it(tmp_path, launched):
    """Finding 5: events.jsonl gone (deleted, or not copied with the run) while .fence says 7: the next group
    used to number itself from the events (0), below the fence, and fence itself (the run failed in 3 s). The
    launcher now numbers it past the fence, and the run finishes."""
    wd = tmp_path / "run"
    wd.mkdir()
    fence.write_fence(str(wd), 7)
    run = launched(str(wd), 1, fake_args(6, 3))
    assert run.wait(120) == 0, run.output()
    assert [r["attempt"] for r in events(str(wd), "launch")] == [7]
    assert last_metric_step(str(wd)) == 6


def test_the_supervisor_refuses_to_start_on_a_fence_it_cannot_read(tmp_path):
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / fence.FENCE_FILE).mkdir()  # read() fails with EISDIR
    backend = backends.LocalBackend(1)
    with pytest.raises(RuntimeError, match=r"cannot read the fence .*remove it"):
        Supervisor(backend, WorkerSettings(argv=["true"]), PolicyConfig(), str(wd), verbose=False)


BLOCKED_STDERR = textwrap.dedent(
    """
    import os, sys, threading, time
    from reve_jax.elastic.fence import Fence
    Fence(sys.argv[1], attempt=3, poll_s=0.1).install()
    # stderr is a pipe nobody reads (a cut-off host's ssh session): fill it until a write blocks, as logging does.
    threading.Thread(target=lambda: os.write(2, b"x" * (1 << 20)), daemon=True).start()
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_a_fenced_process_whose_stderr_blocks_still_exits(tmp_path):
    """Found by the chaos soak: a partitioned worker's stderr goes to an ssh session nobody drains any more, so
    the fence's farewell line blocked (or raised EPIPE once the session was gone) and the process lived on."""
    wd = tmp_path / "run"
    wd.mkdir()
    fence.write_fence(str(wd), 3)
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_STDERR, str(wd)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.5)  # the pipe is full now
        fence.write_fence(str(wd), 4)
        t0 = time.monotonic()
        code = proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert code == fence.EXIT_FENCED and time.monotonic() - t0 < 5

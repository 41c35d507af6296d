"""Warm standbys (reve_jax/elastic/standby.py): the pool starts one per host, hands out only ready ones that beat
recently, forgets dead ones and does not restart a host's standby in a loop; a standby process imports, waits
for its assignment over the signed channel and comes back with the group's variables."""

import os
import subprocess
import sys
import textwrap
import time

from reve_jax.elastic import standby
from reve_jax.elastic.channel import HeartbeatServer


class FakeProc:
    def __init__(self):
        self.code, self.pid, self.killed = None, 123, False

    def poll(self):
        return self.code

    def kill(self):
        self.killed = True


def test_pool_hands_out_ready_fresh_standbys_only():
    now = [0.0]
    started = []

    def start(host, argv, env, log):
        started.append((host, env["REVE_STANDBY"], env["REVE_HOST"]))
        return FakeProc()

    pool = standby.StandbyPool(start, ["python", "w.py"], {"X": "1"}, "/tmp/logs", clock=lambda: now[0])
    pool.ensure(["a", "b"])
    assert [(h, host) for h, _, host in started] == [("a", "a"), ("b", "b")]
    token_a = started[0][1]
    assert pool.take("a") == (None, "still importing")
    pool.beat(now[0], {"standby": token_a, "phase": "standby"})
    now[0] += standby.READY_WITHIN + 0.5
    assert pool.take("a")[0] is None  # ready, but silent too long (frozen, cut off)
    silent = standby.READY_WITHIN + 0.3  # also when the channel was last read a little before the launch
    assert pool.take("a", silent) == (None, f"silent for {silent:.1f} s")
    pool.beat(now[0], {"standby": token_a, "phase": "standby"})
    read_at = now[0] + 0.1  # the supervisor read that beat, then was busy (killing a group) until the launch
    now[0] += standby.READY_WITHIN + 0.5
    s, why = pool.take("a", read_at)
    assert s is not None and why == "" and s.host == "a" and "a" not in pool.by_host
    assert pool.take("a") == (None, "none started")
    pool.beat(now[0], {"standby": pool.by_host["b"].token, "phase": "standby"})
    pool.by_host["b"].proc.code = 1  # b's standby died after its beat
    assert pool.take("b", now[0]) == (None, "exited") and "b" not in pool.by_host
    pool.ensure(["a", "b"])
    assert [h for h, _, _ in started] == ["a", "b"]  # both started less than RESTART_AFTER s ago: no restart loop
    now[0] += standby.RESTART_AFTER
    pool.ensure(["a", "b"])
    assert [h for h, _, _ in started] == ["a", "b", "a", "b"]
    pool.by_host["b"].proc.code = 1  # the new b dies while waiting: poll forgets it
    pool.poll()
    assert sorted(pool.by_host) == ["a"]
    pool.ensure(["a", "b"])
    assert len(started) == 4
    procs = pool.close()
    assert len(procs) == 1 and all(p.killed for p in procs)


CHILD = textwrap.dedent(
    """
    import os, sys
    from reve_jax.elastic import auth, standby
    env = dict(os.environ)
    secret = auth.secret_from_env(env)
    got = standby.wait_for_assignment(env, secret)
    print("assigned", got["REVE_ATTEMPT"], env["REVE_PROCESS_ID"], "REVE_STANDBY" in env, flush=True)
    """
)


def test_standby_process_waits_for_its_assignment():
    server = HeartbeatServer(bind="127.0.0.1").start()
    env = dict(
        os.environ, REVE_HEARTBEAT=f"127.0.0.1:{server.port}", REVE_SECRET=server.secret.hex(), REVE_HOST="h",
        REVE_STANDBY="s7", REVE_STANDBY_IMPORTS="json,no_such_module_here",
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        msgs = []
        while not any(m.get("phase") == "standby" for m in msgs):  # imports done (a missing one is skipped)
            msgs += [m for _, m in server.drain()]
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        assert all(m["standby"] == "s7" and m["host"] == "h" for m in msgs)
        server.assign("s7", {"REVE_ATTEMPT": "4", "REVE_PROCESS_ID": "1"})
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        server.close()
    assert out.decode().split() == ["assigned", "4", "1", "False"], err.decode()
    assert b"cannot import no_such_module_here" in err


def test_a_standby_the_pool_dropped_is_retired_and_exits():
    """Found by the chaos soak: a standby on a host cut off the network loses its ssh (the local process exits
    255) while it runs on, cut off; the pool forgot it, so nobody killed it, and once the link was back it beat
    again and lived on. Now the pool hands back what it drops (to be killed), and the channel tells a dropped
    standby to go: it exits at its next beat."""
    pool = standby.StandbyPool(lambda *a: FakeProc(), ["python", "w.py"], {}, "/tmp/logs")
    pool.ensure(["a"])
    lost = pool.by_host["a"]
    lost.proc.code = 255
    assert pool.poll() == [lost] and lost.proc.killed and pool.by_host == {}
    server = HeartbeatServer(bind="127.0.0.1").start()
    env = dict(
        os.environ, REVE_HEARTBEAT=f"127.0.0.1:{server.port}", REVE_SECRET=server.secret.hex(), REVE_HOST="a",
        REVE_STANDBY=lost.token, REVE_STANDBY_IMPORTS="json",
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not any(m.get("standby") == lost.token for _, m in server.drain()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        server.retire(lost.token)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        server.close()
    assert proc.returncode == 0 and out == b"" and b"retired" in err, (out, err)

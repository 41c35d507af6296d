"""The heartbeat channel over real TCP, fed to the policy: beats, stop replies, stale and no-progress detection;
authentication (forged, replayed, oversized messages)."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from reve_jax.elastic import auth
from reve_jax.elastic import policy as P
from reve_jax.elastic.channel import HeartbeatClient, HeartbeatServer, main_thread_location
from reve_jax.elastic.supervisor import _beat_from
from reve_jax.elastic.worker import init_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def client(server, host, attempt=0, interval=0.05):
    identity = {"host": host, "attempt": attempt}
    return HeartbeatClient(f"127.0.0.1:{server.port}", identity, server.secret, interval).start()


def test_beats_arrive_with_step_phase_start_step_and_stop_reply():
    server = HeartbeatServer(bind="127.0.0.1").start()
    c = client(server, "a", attempt=3)
    try:
        c.update(-1, "restoring")
        c.update(7, "compiling")  # the restored step
        c.update(9, "train")
        got = []
        assert wait_for(lambda: got.extend(m for _, m in server.drain()) or any(m["step"] == 9 for m in got))
        last = [m for m in got if m["step"] == 9][-1]
        assert last["host"] == "a" and last["attempt"] == 3 and last["phase"] == "train"
        assert last["start_step"] == 7
        assert last["where"].count(":") == 2  # file:line:function of the main thread
        assert not c.stop_event.is_set()
        server.request_stop(2)  # another group
        time.sleep(0.2)
        assert not c.stop_event.is_set()
        server.request_stop(3)
        assert wait_for(c.stop_event.is_set)
    finally:
        c.close()
        server.close()


def test_client_survives_a_missing_supervisor():
    server = HeartbeatServer(bind="127.0.0.1")
    port = server.port
    server.close()  # nothing listens: the client keeps trying without raising or blocking update()
    c = HeartbeatClient(f"127.0.0.1:{port}", {"host": "a", "attempt": 0}, b"k" * 32, 0.05).start()
    t0 = time.perf_counter()
    for s in range(1000):
        c.update(s, "train")
    assert time.perf_counter() - t0 < 0.5
    c.close(flush=False)


def test_policy_detects_stale_and_stuck_hosts_over_the_channel():
    """Host a beats and progresses, b beats at a fixed step (alive, hung), c stops beating (gone)."""
    server = HeartbeatServer(bind="127.0.0.1").start()
    config = P.PolicyConfig(heartbeat_timeout=0.6, progress_timeout=1.0, hang_slack=0.3)
    policy = P.Policy(["a", "b", "c"], config)
    policy.start(time.monotonic())
    clients = {h: client(server, h) for h in "abc"}
    failures = []
    try:
        for cl in clients.values():
            cl.update(0, "compiling")
        step, t_end = 0, time.monotonic() + 4.0
        while time.monotonic() < t_end and len(failures) < 2:
            step += 1
            clients["a"].update(step, "train")
            if step == 3:
                clients["c"].close(flush=False)  # c goes silent
            if step <= 2:
                clients["b"].update(step, "train")
            for t, msg in server.drain():
                for a in policy.step(_beat_from(t, msg)):
                    if isinstance(a, P.Record) and a.kind == "failure":
                        failures.append(a.data)
            for a in policy.step(P.Tick(time.monotonic())):
                if isinstance(a, P.Record) and a.kind == "failure":
                    failures.append(a.data)
            if failures and policy.group is not None and policy.group.mode == "killing":
                break
            time.sleep(0.05)
    finally:
        for cl in clients.values():
            cl.close(flush=False)
        server.close()
    # c's heartbeat stops first (0.6 s); b would be caught for no progress (1.0 s) had the group not been killed.
    assert failures and failures[0]["hosts"] == ["c"] and failures[0]["reason"] == "heartbeat lost"
    assert 0.6 <= failures[0]["detection_s"] < 1.5


def test_no_progress_detected_while_beats_continue():
    server = HeartbeatServer(bind="127.0.0.1").start()
    policy = P.Policy(["a", "b"], P.PolicyConfig(heartbeat_timeout=2.0, progress_timeout=0.8, hang_slack=0.2))
    policy.start(time.monotonic())
    clients = {h: client(server, h) for h in "ab"}
    failures = []
    try:
        for cl in clients.values():
            cl.update(0, "compiling")
        for s in range(1, 4):
            for cl in clients.values():
                cl.update(s, "train")
            time.sleep(0.05)
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end and not failures:
            clients["a"].update(int((time.monotonic() - t_end) * 100), "train")  # a progresses, b does not
            events = [_beat_from(t, m) for t, m in server.drain()] + [P.Tick(time.monotonic())]
            for ev in events:
                failures += [a.data for a in policy.step(ev) if isinstance(a, P.Record) and a.kind == "failure"]
            time.sleep(0.05)
    finally:
        for cl in clients.values():
            cl.close(flush=False)
        server.close()
    assert failures and failures[0]["hosts"] == ["b"] and failures[0]["reason"] == "no progress"
    assert 0.8 <= failures[0]["detection_s"] < 1.6


def test_main_thread_location_names_the_waiting_frame():
    """Asked from another thread (as the beat thread asks), it names the main thread's own innermost frame: the
    file, line and function the main thread is blocked in, not the frame of the thread that asks (nor its
    caller's)."""
    main_id = threading.main_thread().ident
    assert threading.get_ident() == main_id  # the test runs on the main thread
    blocker = threading.Lock()
    blocker.acquire()
    seen = []

    def main_waits_here():
        return blocker.acquire(timeout=5)  # a C call: the innermost Python frame is this line

    def look():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the main thread is blocked in main_waits_here
            frame = sys._current_frames().get(main_id)
            if frame is not None and frame.f_code is main_waits_here.__code__:
                break
            time.sleep(0.01)
        seen.append(main_thread_location(main_id))
        blocker.release()

    helper = threading.Thread(target=look, daemon=True)
    helper.start()
    assert main_waits_here()
    helper.join(5)
    line = main_waits_here.__code__.co_firstlineno + 1
    assert seen == [f"test_elastic_channel.py:{line}:main_waits_here"]


def test_init_from_env_single_process_and_stop_on_sigterm():
    assert not init_from_env({}).supervised  # no REVE_* variables: a plain run
    server = HeartbeatServer(bind="127.0.0.1").start()
    env = {
        "REVE_NUM_PROCESSES": "1",
        "REVE_PROCESS_ID": "0",
        "REVE_HOST": "h",
        "REVE_ATTEMPT": "4",
        "REVE_HEARTBEAT": f"127.0.0.1:{server.port}",
        "REVE_HEARTBEAT_INTERVAL": "0.05",
        "REVE_SECRET": server.secret.hex(),
    }
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ctx = init_from_env(env)
        assert "REVE_SECRET" not in env  # taken out of the environment once read
        assert (ctx.process_id, ctx.num_processes, ctx.attempt, ctx.supervised) == (0, 1, 4, True)
        ctx.beat(5, "train")
        assert wait_for(lambda: any(m.get("step") == 5 for _, m in server.drain()))
        assert not ctx.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(ctx.stop_requested)
        ctx.close()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        server.close()


# The supervisor's side, in a process of its own so that it can die: it prints its port, then every beat.
_SUPERVISOR = """
import json, os, time
from reve_jax.elastic.channel import HeartbeatServer
server = HeartbeatServer(bind="127.0.0.1", secret=bytes.fromhex(os.environ["TEST_SECRET"])).start()
print(server.port, flush=True)
while True:
    for _, m in server.drain():
        print(json.dumps({"step": m["step"], "phase": m["phase"]}), flush=True)
    time.sleep(0.02)
"""

# A supervised worker whose main thread then hangs (as in a collective that never returns): only its beat
# thread can notice that the supervisor is gone.
_HUNG_WORKER = """
import threading
from reve_jax.elastic.worker import init_from_env
ctx = init_from_env()
ctx.beat(1, "train")
threading.Event().wait()
"""


def _lines(proc) -> queue.SimpleQueue:
    """The lines `proc` prints, read by a thread of their own (so that waiting on them has a deadline)."""
    out: queue.SimpleQueue = queue.SimpleQueue()

    def read():
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=read, daemon=True).start()
    return out


@pytest.mark.parametrize(("gone", "orphan_timeout"), [("killed", 1.0), ("stopped", 3.0)])
def test_a_hung_worker_exits_by_itself_once_its_supervisor_is_gone(gone, orphan_timeout):
    """The orphan exit (REVE_ORPHAN_TIMEOUT, HeartbeatClient): a worker whose main thread hangs stays up while
    the supervisor answers its beats, for longer than the orphan timeout; once the supervisor is gone it exits
    by itself with status 3 and "heartbeat: supervisor unreachable, exiting" on stderr, about the orphan timeout
    after the last reply. Gone: its process killed (the connection refused from then on), or stopped (SIGSTOP:
    connections still accepted by the kernel, beats still sent, but no reply ever comes; the orphan timeout is
    then longer than a beat's wait for its reply, so that only replies, not beats sent, can keep it alive). A
    worker that outlives its supervisor fails here, and so does one that counts a beat sent as a sign of life."""
    reply_timeout = 2.0  # HeartbeatClient's socket timeout: how long one beat waits for its reply
    secret = auth.new_secret()
    env = dict(os.environ, PYTHONPATH=ROOT, TEST_SECRET=secret.hex())
    procs = []
    try:
        sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR], env=env, stdout=subprocess.PIPE, text=True)
        procs.append(sup)
        sup_out = _lines(sup)
        port = int(sup_out.get(timeout=30))
        worker_env = dict(
            env,
            REVE_NUM_PROCESSES="1",
            REVE_PROCESS_ID="0",
            REVE_HOST="h",
            REVE_HEARTBEAT=f"127.0.0.1:{port}",
            REVE_HEARTBEAT_INTERVAL="0.05",
            REVE_ORPHAN_TIMEOUT=str(orphan_timeout),
            REVE_SECRET=secret.hex(),
        )
        worker = subprocess.Popen(
            [sys.executable, "-c", _HUNG_WORKER], env=worker_env, stderr=subprocess.PIPE, text=True
        )
        procs.append(worker)
        deadline = time.monotonic() + 30
        while json.loads(sup_out.get(timeout=max(0.0, deadline - time.monotonic())))["step"] != 1:
            pass  # until the worker, hung from now on, has beaten step 1
        time.sleep(orphan_timeout + 0.5)  # answered all along: no orphan
        assert worker.poll() is None, worker.stderr.read()
        assert not sup_out.empty()  # its beats went on
        if gone == "killed":
            sup.kill()
            sup.wait(timeout=10)
        else:
            sup.send_signal(signal.SIGSTOP)
        t_gone = time.monotonic()
        code = worker.wait(timeout=reply_timeout + orphan_timeout + 10)
        gone_for = time.monotonic() - t_gone
        stderr = worker.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a stopped process too
            p.wait(timeout=10)
    print(f"the worker exited {gone_for:.2f} s after its supervisor was {gone}")
    assert code == 3 and "heartbeat: supervisor unreachable, exiting" in stderr, (code, stderr)
    # Its last reply came at most a beat interval before; it exits at the first failed beat after the orphan
    # timeout: refused at once when killed, a reply timeout later when stopped (the slack: a loaded machine).
    late = 0.0 if gone == "killed" else reply_timeout
    assert orphan_timeout - 0.1 <= gone_for < orphan_timeout + late + 2.0, gone_for


def test_stop_on_signals_sets_the_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    from reve_jax.elastic.worker import stop_on_signals

    with stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(stop.is_set)
    assert signal.getsignal(signal.SIGTERM) is before

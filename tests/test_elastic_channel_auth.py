"""The control channel lets no one else in: forged, replayed, unsigned and oversized messages are dropped and
counted, a dead host is detected while someone forges its beats, and a huge line does not grow memory."""

import json
import socket
import time

import pytest

from reve_jax.elastic import auth
from reve_jax.elastic import policy as P
from reve_jax.elastic.channel import HeartbeatClient, HeartbeatServer
from reve_jax.elastic.supervisor import _beat_from


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def server():
    s = HeartbeatServer(bind="127.0.0.1", idle_timeout=5.0).start()
    yield s
    s.close()


def send_raw(port: int, data: bytes, read: bool = True) -> bytes:
    """Sends `data` on a fresh connection; returns what came back before the server closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return s.makefile("rb").read() if read else b""


def rejections(server, want: int) -> dict:
    got: dict = {}

    def more():
        r = server.take_rejections()
        for k, v in r.get("counts", {}).items():
            got[k] = got.get(k, 0) + v
        return sum(got.values()) >= want

    assert wait_for(more), got
    return got


def test_forged_unsigned_and_replayed_beats_are_dropped_and_counted(server):
    forged = {"host": "local1", "attempt": 0, "step": 999, "phase": "train"}
    assert send_raw(server.port, json.dumps(forged).encode() + b"\n") == b""  # the old format: no answer
    wrong_key = auth.sign(b"x" * 32, dict(forged, sid="s", n=1))
    assert send_raw(server.port, wrong_key) == b""
    good = auth.sign(server.secret, dict(forged, sid="s", n=1))
    reply = auth.verify(server.secret, send_raw(server.port, good))
    assert reply == {"sid": "s", "n": 1, "stop": False, "fenced": False}
    assert send_raw(server.port, good) == b""  # the same line again: a replay
    unsigned_counter = auth.sign(server.secret, {"host": "a"})  # signed but without sid/n
    assert send_raw(server.port, unsigned_counter) == b""
    beats = [m for _, m in server.drain()]
    assert len(beats) == 1 and beats[0]["n"] == 1
    assert rejections(server, 4) == {"bad_mac": 2, "replay": 1, "malformed": 1}


def test_replies_are_signed_and_a_forged_stop_is_ignored():
    """A fake 'supervisor' that answers {"stop": true} without the secret does not stop the worker."""
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]
    c = HeartbeatClient(f"127.0.0.1:{port}", {"host": "a", "attempt": 0}, b"k" * 32, 0.05).start()
    try:
        conn, _ = fake.accept()
        conn.makefile("rb").readline()
        conn.sendall(b'{"stop": true}\n')
        conn.sendall(auth.sign(b"z" * 32, {"stop": True, "sid": "x", "n": 1}))
        time.sleep(0.3)
        assert not c.stop_event.is_set()
    finally:
        c.close(flush=False)
        fake.close()


def test_dead_host_is_detected_while_its_beats_are_forged(server):
    """Host b's worker is gone; an attacker keeps sending beats in b's name (no secret, and replays of b's last
    genuine line). The policy still declares b lost after the heartbeat timeout."""
    policy = P.Policy(["a", "b"], P.PolicyConfig(heartbeat_timeout=0.8, progress_timeout=30))
    policy.start(time.monotonic())
    clients = {
        h: HeartbeatClient(f"127.0.0.1:{server.port}", {"host": h, "attempt": 0}, server.secret, 0.05).start()
        for h in "ab"
    }
    captured = auth.sign(server.secret, {"host": "b", "attempt": 0, "step": 1, "phase": "train", "sid": "b", "n": 1})
    assert auth.verify(server.secret, send_raw(server.port, captured))["n"] == 1  # b's genuine line, recorded
    failures = []
    try:
        for cl in clients.values():
            cl.update(1, "train")
        time.sleep(0.2)
        clients["b"].close(flush=False)  # b dies
        forged = json.dumps({"host": "b", "attempt": 0, "step": 2, "phase": "train"}).encode() + b"\n"
        t_end = time.monotonic() + 4.0
        step = 1
        while time.monotonic() < t_end and not failures:
            step += 1
            clients["a"].update(step, "train")
            send_raw(server.port, forged)
            send_raw(server.port, captured)
            for t, msg in server.drain():
                failures += [a.data for a in policy.step(_beat_from(t, msg)) if getattr(a, "kind", "") == "failure"]
            failures += [a.data for a in policy.step(P.Tick(time.monotonic())) if getattr(a, "kind", "") == "failure"]
            time.sleep(0.05)
    finally:
        for cl in clients.values():
            cl.close(flush=False)
    assert failures and failures[0]["hosts"] == ["b"] and failures[0]["reason"] == "heartbeat lost"
    counts = server.take_rejections()["counts"]
    assert counts["bad_mac"] >= 3 and counts["replay"] >= 3


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_oversized_line_is_cut_off_without_growing_memory(server):
    """50 MB without a newline: the server reads at most auth.MAX_LINE + 1 bytes of it, closes the connection
    and counts it; the process's resident memory does not grow by anything like the line."""
    chunk = b"x" * (1 << 20)
    before = _rss_bytes()
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        try:
            while sent < 50 << 20:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset once the server has closed its end
            pass
    grown = _rss_bytes() - before
    print(f"sent {sent >> 20} MiB before the server closed the connection; RSS grew {grown / 2**20:.1f} MiB")
    assert sent < 50 << 20 or grown < 8 << 20
    assert grown < 8 << 20
    assert rejections(server, 1) == {"oversized": 1}
    # The channel still works for the run's own clients.
    c = HeartbeatClient(f"127.0.0.1:{server.port}", {"host": "a", "attempt": 0}, server.secret, 0.05).start()
    try:
        c.update(3, "train")
        assert wait_for(lambda: any(m["step"] == 3 for _, m in server.drain()))
    finally:
        c.close(flush=False)


def test_connections_beyond_the_limit_are_refused_and_counted():
    server = HeartbeatServer(bind="127.0.0.1", max_connections=2, idle_timeout=5.0).start()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert extra.makefile("rb").read() == b""  # closed at once
        assert rejections(server, 1) == {"too_many_connections": 1}
    finally:
        for s in socks:
            s.close()
        server.close()


def test_secret_comes_from_the_environment_and_leaves_it():
    env = {"REVE_SECRET": "ab" * 32, "OTHER": "1"}
    assert auth.secret_from_env(env) == bytes.fromhex("ab" * 32) and env == {"OTHER": "1"}
    assert auth.secret_from_env({}) is None

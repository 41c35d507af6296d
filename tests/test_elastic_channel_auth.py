"""The control channel lets no one else in: forged, replayed, unsigned and oversized messages are dropped and
counted, a dead host is detected while someone forges its beats, and a huge line does not grow memory."""

import contextlib
import json
import socket
import threading
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


def keys(server) -> tuple[bytes, bytes]:
    """(request key, reply key) of a server's channel."""
    return auth.keys(server.secret, "heartbeat")


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
    request, reply_key = keys(server)
    good = auth.sign(request, dict(forged, sid="s", n=1))
    reply = auth.verify(reply_key, send_raw(server.port, good))
    assert reply == {"sid": "s", "n": 1, "stop": False, "fenced": False}
    assert send_raw(server.port, good) == b""  # the same line again: a replay
    unsigned_counter = auth.sign(request, {"host": "a"})  # signed but without sid/n
    assert send_raw(server.port, unsigned_counter) == b""
    # The run's secret itself, or the reply key, signs nothing the server accepts: keys are bound to a direction.
    assert send_raw(server.port, auth.sign(server.secret, dict(forged, sid="t", n=1))) == b""
    assert send_raw(server.port, auth.sign(reply_key, dict(forged, sid="u", n=1))) == b""
    beats = [m for _, m in server.drain()]
    assert len(beats) == 1 and beats[0]["n"] == 1
    assert rejections(server, 6) == {"bad_mac": 4, "replay": 1, "malformed": 1}


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
    request, reply_key = keys(server)
    captured = auth.sign(request, {"host": "b", "attempt": 0, "step": 1, "phase": "train", "sid": "b", "n": 1})
    assert auth.verify(reply_key, send_raw(server.port, captured))["n"] == 1  # b's genuine line, recorded
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


def test_pending_connections_are_evicted_oldest_first_and_authenticated_ones_capped():
    """Connections that have not sent a signed line yet hold no slot a worker needs: beyond `max_pending`, the
    oldest is closed; one that sends no line in `first_line_s` is closed too. Authenticated connections beyond
    `max_connections` are refused. Each is counted."""
    server = HeartbeatServer(bind="127.0.0.1", max_connections=1, max_pending=2, first_line_s=1.0).start()
    request, _ = keys(server)
    try:
        first = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        time.sleep(0.1)
        others = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
        assert first.makefile("rb").read() == b""  # the oldest pending one was closed
        assert rejections(server, 1) == {"evicted": 1}
        assert [s.makefile("rb").read() for s in others] == [b"", b""]  # no line within 1 s
        assert rejections(server, 2) == {"first_line_timeout": 2}
        held = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        held.sendall(auth.sign(request, {"host": "a", "attempt": 0, "step": 0, "sid": "a", "n": 1}))
        assert held.makefile("rb").readline()  # answered: it holds the one serving slot
        second = auth.sign(request, {"host": "b", "attempt": 0, "step": 0, "sid": "b", "n": 1})
        assert send_raw(server.port, second) == b""
        assert rejections(server, 1) == {"too_many_connections": 1}
        for s in [first, held, *others]:
            s.close()
    finally:
        server.close()


def test_secret_comes_from_the_environment_and_leaves_it():
    env = {"REVE_SECRET": "ab" * 32, "OTHER": "1"}
    assert auth.secret_from_env(env) == bytes.fromhex("ab" * 32) and env == {"OTHER": "1"}
    assert auth.secret_from_env({}) is None


class Flood:
    """An attacker on the workers' own address who knows no secret: `idle` connections that send nothing and
    `drip` connections that send one byte every `drip_s` (no newline), each reopened as soon as it is closed."""

    def __init__(self, port: int, idle: int, drip: int, drip_s: float = 0.5):
        self.port, self.drip_s = port, drip_s
        self.stopping = threading.Event()
        self.opened = 0
        self._threads = [threading.Thread(target=self._hold, args=(False,), daemon=True) for _ in range(idle)]
        self._threads += [threading.Thread(target=self._hold, args=(True,), daemon=True) for _ in range(drip)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=5)

    def _hold(self, drip: bool) -> None:
        while not self.stopping.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    self.opened += 1
                    s.settimeout(self.drip_s)
                    while not self.stopping.is_set():
                        if drip:
                            s.sendall(b"a")
                        try:
                            if s.recv(1) == b"":
                                break  # the server closed it: open another
                        except TimeoutError:
                            continue
            except OSError:
                time.sleep(0.01)


def test_a_flood_of_idle_and_dripping_connections_does_not_keep_beats_out():
    """Finding 1: 300 idle and 300 byte-dripping connections from the workers' own address, reopened whenever
    closed, against a server with the supervisor's limits. A worker (and a standby) that connects during the
    flood gets its first signed beat through within 2 s, and keeps beating."""
    server = HeartbeatServer(bind="127.0.0.1", max_connections=64).start()
    clients = []
    try:
        with Flood(server.port, idle=300, drip=300) as flood:
            time.sleep(1.0)  # the flood holds whatever it can
            assert flood.opened >= 300
            t0 = time.monotonic()
            for h in ("a", "standby"):
                c = HeartbeatClient(f"127.0.0.1:{server.port}", {"host": h, "attempt": 0}, server.secret, 0.1)
                clients.append(c.start())
                c.update(1, "train")
            seen: dict[str, float] = {}
            counts = {"a": 0, "standby": 0}
            while time.monotonic() - t0 < 4.0:
                for t, msg in server.drain():
                    seen.setdefault(msg["host"], t - t0)
                    counts[msg["host"]] += 1
                time.sleep(0.05)
        print(f"first beat after {seen} s; beats in 4 s {counts}; flood opened {flood.opened} connections")
        assert set(seen) == {"a", "standby"} and max(seen.values()) < 2.0, seen
        assert min(counts.values()) >= 15, counts  # ~40 at 0.1 s: beats keep coming, not one lucky one
        assert all(c.last_reply.get("stop") is False for c in clients)
    finally:
        for c in clients:
            c.close(flush=False)
        server.close()


def test_a_worker_ignores_its_own_beat_reflected_as_a_reply():
    """Finding 8: a man in the middle answers each beat with the worker's own signed line. Requests and replies
    are signed under different keys, so the reflection counts as no reply: the worker does not take it for the
    supervisor's (which would defeat the orphan exit and hide stop/fenced)."""
    mirror = socket.create_server(("127.0.0.1", 0))
    port = mirror.getsockname()[1]
    reflected = []

    def reflect():
        with contextlib.suppress(OSError):
            while True:  # the client hangs up on a reply it refuses, and reconnects
                conn, _ = mirror.accept()
                with conn, conn.makefile("rb") as f:
                    while line := f.readline():
                        reflected.append(line)
                        conn.sendall(line)

    threading.Thread(target=reflect, daemon=True).start()
    c = HeartbeatClient(f"127.0.0.1:{port}", {"host": "a", "attempt": 0}, b"k" * 32, 0.05).start()
    try:
        c.update(1, "train")
        t0 = time.monotonic()
        assert wait_for(lambda: len(reflected) >= 3)
        time.sleep(0.3)
        # Its orphan clock runs from its start: no reflected line counted as the supervisor's reply.
        assert c.last_reply == {} and c.seconds_since_reply() >= time.monotonic() - t0, c.last_reply
    finally:
        c.close(flush=False)
        mirror.close()

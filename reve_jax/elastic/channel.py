"""The supervisor's health channel: signed JSON lines over TCP (auth.py); each reply says whether to stop.

It is the supervisor's own channel, apart from JAX's coordination service, so it keeps working across hosts
while a collective hangs, and a beat carries what the policy needs: the step, the phase, the restored step
and where the main thread is. Beats are sent by a background thread, so a main thread stuck in a collective
stops the step from advancing while the beats go on: "alive, no progress" and "gone" stay apart.

Only the run's processes get in: every line carries an HMAC under a key derived from the run's secret (one key
for beats, another for replies) and a fresh counter; lines without one, replays and lines longer than
auth.MAX_LINE are dropped (the connection closed) and counted for events.jsonl. A connection gets a serving
thread only once its first line is authenticated (gate.py). The server listens on the one address the workers
use (127.0.0.1 for local runs).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import sys
import threading
import time

from reve_jax.elastic import auth, gate

CHANNEL = "heartbeat"  # the name under which the channel's keys are derived from the run's secret (auth.keys)

# Phases a worker reports before its state is restored (see policy.PRE_RESTORE_PHASES).
_PRE_RESTORE = ("warming", "standby", "starting", "joining", "restoring", "exiting")


class HeartbeatServer:
    """TCP server of the supervisor; every signed line a worker sends is one beat, answered with a signed
    `{"stop": bool, ...}`. Lines that fail the MAC, replay a counter or exceed auth.MAX_LINE are dropped and
    counted (`take_rejections`), and so are connections that do not prove they hold the secret in time (gate.py:
    a flood of idle or dripping connections cannot keep the workers' beats out).

    `bind` and `port` say where to listen (port 0: any free port, read it back from `.port`): only the address
    the workers reach, never every interface. `secret` is the run's key (default: a fresh one, `.secret`); lines
    are verified and replies signed under keys derived from it (auth.keys). `clock` stamps each beat on arrival,
    so beats are timed on the supervisor's clock only. `max_connections` bounds the authenticated connections,
    `max_pending` those still to send their first line (the oldest is closed when it is full), `first_line_s`
    how long one may take to, and `idle_timeout` how long an authenticated one may stay silent.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: int = 0,
        clock=time.monotonic,
        secret: bytes | None = None,
        max_connections: int = 256,
        idle_timeout: float = 60.0,
        max_pending: int = 128,
        first_line_s: float = 5.0,
    ):
        self.secret = secret or auth.new_secret()
        self._request_key, self._reply_key = auth.keys(self.secret, CHANNEL)
        self.idle_timeout, self.max_connections = idle_timeout, max_connections
        self._clock = clock
        self._beats: queue.SimpleQueue = queue.SimpleQueue()
        self._stop_attempts: set[int] = set()
        self._fence = -1  # groups numbered below this one are fenced off
        self._assignments: dict[str, dict] = {}  # standby token -> the variables of its place in a group
        self._retired: set[str] = set()  # standby tokens told to exit
        self._lock = threading.Lock()
        self._last_n: dict[str, int] = {}  # client session -> last counter accepted
        self._rejected: collections.Counter = collections.Counter()
        self._rejected_peers: dict[str, set[str]] = {}
        self._sock = gate.listen(bind, port)
        self._gate = gate.Gate(
            self._sock,
            lambda line: auth.verify(self._request_key, line),
            self._serve,
            self._reject,
            max_pending=max_pending,
            first_line_s=first_line_s,
            max_served=max_connections,
            name="heartbeat-server",
        )

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def start(self) -> HeartbeatServer:
        self._gate.start()
        return self

    def _serve(self, conn: socket.socket, msg: dict, peer: str) -> None:
        """One authenticated client: answers its first line, then every line it sends until it goes quiet."""
        conn.settimeout(self.idle_timeout)  # a silent client (a stopped worker) gives its slot back
        with conn.makefile("rb") as reader:
            while True:
                try:
                    conn.sendall(auth.sign(self._reply_key, self._received(msg)))
                    # At most MAX_LINE + 1 bytes are read into memory whatever the peer sends.
                    line = reader.readline(auth.MAX_LINE + 1)
                    if not line:
                        return
                    msg = auth.verify(self._request_key, line)
                except auth.Rejected as e:
                    self._reject(e.reason, peer)
                    return  # a peer that does not know the secret gets nothing back, not even an error
                except OSError:  # idle timeout or reset
                    return

    def _received(self, msg: dict) -> dict:
        """Queues an authenticated beat; returns the reply. Raises Rejected for a replayed counter."""
        sid, n = msg.get("sid"), msg.get("n")
        if not isinstance(sid, str) or not isinstance(n, int):
            raise auth.Rejected("malformed")
        with self._lock:
            if n <= self._last_n.get(sid, 0):
                raise auth.Rejected("replay")
            self._last_n[sid] = n
        self._beats.put((self._clock(), msg))
        attempt = msg.get("attempt")
        fenced = isinstance(attempt, int) and 0 <= attempt < self._fence
        reply = {"sid": sid, "n": n, "stop": attempt in self._stop_attempts, "fenced": fenced}
        assignment = self._assignments.get(msg.get("standby"))
        if assignment is not None:
            reply["assign"] = assignment
        elif msg.get("standby") in self._retired:
            reply["retire"] = True
        return reply

    def _reject(self, reason: str, peer: str) -> None:
        with self._lock:
            self._rejected[reason] += 1
            peers = self._rejected_peers.setdefault(reason, set())
            if len(peers) < 8:
                peers.add(peer)

    def take_rejections(self) -> dict:
        """Returns {reason: count} of the messages dropped since the last call plus "peers" {reason: [address]}
        ({} if none), and starts counting afresh."""
        with self._lock:
            if not self._rejected:
                return {}
            out = {"counts": dict(self._rejected), "peers": {k: sorted(v) for k, v in self._rejected_peers.items()}}
            self._rejected.clear()
            self._rejected_peers.clear()
        return out

    def request_stop(self, attempt: int) -> None:
        """From now on, replies to the workers of group `attempt` ask them to stop at the next checkpoint."""
        self._stop_attempts.add(attempt)

    def assign(self, token: str, variables: dict) -> None:
        """The standby `token` gets `variables` (its place in a group) in the reply to its next beat."""
        self._assignments[token] = dict(variables)

    def retire(self, token: str) -> None:
        """The standby `token` is told to exit in the reply to its next beat (the pool dropped it)."""
        self._retired.add(token)

    def fence(self, attempt: int) -> None:
        """From now on, replies to workers of groups numbered below `attempt` tell them they are fenced off."""
        self._fence = max(self._fence, attempt)

    def drain(self) -> list[tuple[float, dict]]:
        """Returns the beats received since the last call, as (arrival time, message) in arrival order."""
        out = []
        while True:
            try:
                out.append(self._beats.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._gate.close()


def main_thread_location(thread_id: int) -> str:
    """Returns "file:line:function" of the innermost Python frame of thread `thread_id` ("" if unknown)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}"


class HeartbeatClient:
    """The worker's end: a daemon thread that sends the latest (step, phase) every `interval` s.

    `address` is "host:port" of the supervisor's server; `identity` is merged into every message (host,
    attempt, process id); `secret` is the run's key (auth.py). `update` only stores values, so the training
    loop never waits on the network. A phase change is sent at once. `orphan_timeout` > 0 makes the process
    exit (code 3) once the supervisor has been unreachable that long, so workers on remote hosts do not
    outlive a dead supervisor. A reply that fails its MAC or echoes another counter counts as no reply.
    `on_fenced` is called (from the beat thread) when a reply says this group was fenced off (fence.py).
    """

    def __init__(
        self,
        address: str,
        identity: dict,
        secret: bytes,
        interval: float = 0.5,
        orphan_timeout: float = 0.0,
        on_fenced=None,
    ):
        host, port = address.rsplit(":", 1)
        self._on_fenced = on_fenced
        self._addr = (host, int(port))
        self._identity = dict(identity)
        self._request_key, self._reply_key = auth.keys(secret, CHANNEL)
        self._sid, self._n = auth.session_id(), 0
        self._interval = interval
        self._orphan_timeout = orphan_timeout
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the thread and close() may both send
        self._step, self._phase, self._start_step = -1, "starting", None
        self._extra: dict = {}
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.stop_event = threading.Event()  # set once the supervisor asked this group to stop
        self.last_reply: dict = {}
        self._assigned = threading.Event()  # a standby's place in a group arrived (standby.py)
        self._assignment: dict = {}
        self._sock: socket.socket | None = None
        self._reader = None
        self._last_ok = time.monotonic()
        self._main_id = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="heartbeat-client", daemon=True)

    def start(self) -> HeartbeatClient:
        self._thread.start()
        return self

    def update(self, step: int, phase: str, **extra) -> None:
        """Records the worker's current step and phase (and any `extra` fields for the next beats); cheap,
        never blocks on I/O."""
        with self._lock:
            changed = phase != self._phase
            self._step, self._phase = int(step), phase
            self._extra.update(extra)
            if self._start_step is None and phase not in _PRE_RESTORE:
                self._start_step = int(step)
        if changed:
            self._wake.set()

    def restart(self) -> None:
        """Forgets the start step: the next step reported outside the start-up phases is the new one (a group
        that recovered in-process restarted from it). Beats count the restarts, so that the supervisor can tell
        a start step of before the restart, still in flight, from the new one."""
        with self._lock:
            self._start_step = None
            self._extra["restarts"] = self._extra.get("restarts", 0) + 1

    def exiting(self) -> None:
        """Marks the process as on its way out (phase "exiting", the step kept): silence is expected now."""
        with self._lock:
            step = self._step
        self.update(step, "exiting")

    def note(self, wake: bool = False, **extra) -> None:
        """Adds fields to every following beat (e.g. compile seconds so far) without changing step or phase;
        `wake` sends them at once."""
        with self._lock:
            self._extra.update(extra)
        if wake:
            self._wake.set()

    def seconds_since_reply(self) -> float:
        """Seconds since the last reply that proved to come from the supervisor (or since the client was made)."""
        return time.monotonic() - self._last_ok

    def wait_assignment(self) -> dict:
        """Blocks until a reply carries an assignment (a standby's place in a group); returns it, or {} when the
        supervisor retired this standby instead."""
        self._assigned.wait()
        return self._assignment

    def close(self, flush: bool = True) -> None:
        """Stops the thread; with `flush`, sends the latest state once more (bounded by a short timeout)."""
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=2.0)
        if flush:
            self._send_once()
        self._disconnect()

    def _message(self) -> dict:
        with self._lock:
            msg = {"step": self._step, "phase": self._phase, "start_step": self._start_step, **self._extra}
        msg.update(self._identity)
        msg["where"] = main_thread_location(self._main_id) if self._main_id is not None else ""
        return msg

    def _run(self) -> None:
        while not self._closing.is_set():
            self._send_once()
            if self._orphan_timeout and time.monotonic() - self._last_ok > self._orphan_timeout:
                print("heartbeat: supervisor unreachable, exiting", file=sys.stderr, flush=True)
                os._exit(3)
            self._wake.wait(self._interval)
            self._wake.clear()

    def _send_once(self) -> bool:
        with self._send_lock:
            try:
                if self._sock is None:
                    self._sock = socket.create_connection(self._addr, timeout=2.0)
                    self._reader = self._sock.makefile("rb")
                self._n += 1
                msg = dict(self._message(), sid=self._sid, n=self._n)
                self._sock.sendall(auth.sign(self._request_key, msg))
                line = self._reader.readline(auth.MAX_LINE + 1)
                if not line:
                    raise ConnectionError("supervisor closed the channel")
                reply = auth.verify(self._reply_key, line)
                if reply.get("sid") != self._sid or reply.get("n") != self._n:
                    raise auth.Rejected("stale reply")
                self.last_reply = reply
                if reply.get("stop"):
                    self.stop_event.set()
                if reply.get("fenced") and self._on_fenced is not None:
                    self._on_fenced()
                if isinstance(reply.get("assign"), dict) and not self._assigned.is_set():
                    self._assignment = reply["assign"]
                    self._assigned.set()
                elif reply.get("retire"):  # a standby the supervisor dropped: wait_assignment returns {}
                    self._assigned.set()
                self._last_ok = time.monotonic()
                return True
            except (OSError, ValueError):
                self._disconnect()
                return False

    def _disconnect(self) -> None:
        for f in (self._reader, self._sock):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._sock = self._reader = None

"""The supervisor's health channel: heartbeats as JSON lines over TCP; each reply says whether to stop.

It is the supervisor's own channel, apart from JAX's coordination service, so it keeps working across hosts
while a collective hangs, and a beat carries what the policy needs: the step, the phase, the restored step
and where the main thread is. Beats are sent by a background thread, so a main thread stuck in a collective
stops the step from advancing while the beats go on: "alive, no progress" and "gone" stay apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import socketserver
import sys
import threading
import time

# Phases a worker reports before its state is restored (see policy.PRE_RESTORE_PHASES).
_PRE_RESTORE = ("starting", "restoring")


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        owner: HeartbeatServer = self.server.owner  # type: ignore[attr-defined]
        for line in self.rfile:
            try:
                msg = json.loads(line)
            except ValueError:
                return
            owner._received(msg)
            reply = {"stop": msg.get("attempt") in owner._stop_attempts}
            self.wfile.write((json.dumps(reply) + "\n").encode())


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class HeartbeatServer:
    """TCP server of the supervisor; every JSON line a worker sends is one beat, answered `{"stop": bool}`.

    `bind` and `port` say where to listen (port 0: any free port, read it back from `.port`). `clock` stamps
    each beat on arrival, so beats are timed on the supervisor's clock only.
    """

    def __init__(self, bind: str = "0.0.0.0", port: int = 0, clock=time.monotonic):
        self._clock = clock
        self._beats: queue.SimpleQueue = queue.SimpleQueue()
        self._stop_attempts: set[int] = set()
        self._server = _Server((bind, port), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="heartbeat-server", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> HeartbeatServer:
        self._thread.start()
        return self

    def _received(self, msg: dict) -> None:
        self._beats.put((self._clock(), msg))

    def request_stop(self, attempt: int) -> None:
        """From now on, replies to the workers of group `attempt` ask them to stop at the next checkpoint."""
        self._stop_attempts.add(attempt)

    def drain(self) -> list[tuple[float, dict]]:
        """Returns the beats received since the last call, as (arrival time, message) in arrival order."""
        out = []
        while True:
            try:
                out.append(self._beats.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, forever if it never started
            self._server.shutdown()
        self._server.server_close()


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
    attempt, process id). `update` only stores values, so the training loop never waits on the network. A
    phase change is sent at once. `orphan_timeout` > 0 makes the process exit (code 3) once the supervisor
    has been unreachable that long, so workers on remote hosts do not outlive a dead supervisor.
    """

    def __init__(self, address: str, identity: dict, interval: float = 0.5, orphan_timeout: float = 0.0):
        host, port = address.rsplit(":", 1)
        self._addr = (host, int(port))
        self._identity = dict(identity)
        self._interval = interval
        self._orphan_timeout = orphan_timeout
        self._lock = threading.Lock()
        self._step, self._phase, self._start_step = -1, "starting", None
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.stop_event = threading.Event()  # set once the supervisor asked this group to stop
        self._sock: socket.socket | None = None
        self._reader = None
        self._last_ok = time.monotonic()
        self._main_id = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="heartbeat-client", daemon=True)

    def start(self) -> HeartbeatClient:
        self._thread.start()
        return self

    def update(self, step: int, phase: str) -> None:
        """Records the worker's current step and phase; cheap, never blocks on I/O."""
        with self._lock:
            changed = phase != self._phase
            self._step, self._phase = int(step), phase
            if self._start_step is None and phase not in _PRE_RESTORE:
                self._start_step = int(step)
        if changed:
            self._wake.set()

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
            msg = {"step": self._step, "phase": self._phase, "start_step": self._start_step}
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
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self._addr, timeout=2.0)
                self._reader = self._sock.makefile("rb")
            self._sock.sendall((json.dumps(self._message()) + "\n").encode())
            line = self._reader.readline()
            if not line:
                raise ConnectionError("supervisor closed the channel")
            if json.loads(line).get("stop"):
                self.stop_event.set()
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

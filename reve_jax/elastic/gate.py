"""The door of the supervisor's channel and of a host's snapshot server: nobody holds a slot without the secret.

A server that counts connections before they authenticate can be filled by anyone who reaches its port: open
as many connections as there are slots and send a byte now and then, and the run's own workers get no beat
through (the supervisor then strikes every host). So a connection has to earn a serving thread:

- every new connection first waits in a *pending* set, read by one selector thread (no thread per connection),
  with a bounded buffer (auth.MAX_LINE + 1 bytes);
- it must deliver one complete, validly signed line within `first_line_s` seconds of being accepted, counted
  from the accept and not restarted by each byte (a connection dripping a byte a second is closed on time);
- when the pending set is full, the oldest pending connection is closed to make room: a flood evicts the flood,
  while a genuine client, which sends its line in the same moment it connects, is read within a few loop
  turns (at most `ACCEPT_BATCH` connections are accepted per turn, and every turn reads every readable socket);
- only then does the connection get a thread of its own (`serve`), at most `max_served` at once: those are
  connections of holders of the secret.

What is dropped is counted through `on_reject(reason, peer)`: "bad_mac", "malformed", "oversized" (the line),
"evicted" (pushed out by newer pending connections), "first_line_timeout", "too_many_connections" (serving
slots full), "pipelined" (bytes after the first line before its reply: no client of ours does that).
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable

from reve_jax.elastic import auth

ACCEPT_BATCH = 16  # connections accepted per loop turn, so pending ones are read between bursts of accepts


class Gate:
    """Accepts on the listening socket `sock` and hands each connection whose first line `check(line)` accepts
    (returns the message; raises auth.Rejected otherwise) to `serve(conn, msg, peer)` on a thread of its own.
    The connection is blocking again when served; `serve` owns it (closes it when done)."""

    def __init__(
        self,
        sock: socket.socket,
        check: Callable[[bytes], dict],
        serve: Callable[[socket.socket, dict, str], None],
        on_reject: Callable[[str, str], None],
        max_pending: int = 128,
        first_line_s: float = 5.0,
        max_served: int = 64,
        name: str = "gate",
    ):
        self.sock, self.check, self.serve, self.on_reject = sock, check, serve, on_reject
        self.max_pending, self.first_line_s, self.max_served = max_pending, first_line_s, max_served
        self._pending: collections.OrderedDict[socket.socket, list] = collections.OrderedDict()  # oldest first
        self._served = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Gate:
        self._thread.start()
        return self

    @property
    def served(self) -> int:
        """Connections being served now (authenticated)."""
        return self._served

    @property
    def pending(self) -> int:
        """Connections waiting for their first line now."""
        return len(self._pending)

    def close(self) -> None:
        """Stops accepting and closes the pending connections (served ones end with their `serve`)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    ready = self._sel.select(timeout=0.2)
                except (OSError, ValueError):  # the listening socket was closed
                    break
                for key, _ in ready:
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj in self._pending:
                        self._read(key.fileobj)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            with contextlib.suppress(Exception):
                self._sel.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed, or out of descriptors: try again next turn
                return
            while len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                self.on_reject("evicted", self._pending[oldest][1])
                self._drop(oldest)
            conn.setblocking(False)
            self._pending[conn] = [time.monotonic(), addr[0], bytearray()]
            self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        _, peer, buf = self._pending[conn]
        try:
            data = conn.recv(auth.MAX_LINE + 1 - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed before a line: nothing to count (a port scan, a client that gave up)
            self._drop(conn)
            return
        buf += data
        end = buf.find(b"\n")
        if end < 0:
            if len(buf) > auth.MAX_LINE:
                self.on_reject("oversized", peer)
                self._drop(conn)
            return
        line, rest = bytes(buf[: end + 1]), bytes(buf[end + 1 :])
        self._forget(conn)
        try:
            if rest:
                raise auth.Rejected("pipelined")
            msg = self.check(line)
        except auth.Rejected as e:
            self.on_reject(e.reason, peer)
            _close(conn)
            return
        with self._lock:
            full = self._served >= self.max_served
            if not full:
                self._served += 1
        if full:
            self.on_reject("too_many_connections", peer)
            _close(conn)
            return
        conn.setblocking(True)
        threading.Thread(target=self._serve, args=(conn, msg, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, msg: dict, peer: str) -> None:
        try:
            self.serve(conn, msg, peer)
        finally:
            _close(conn)
            with self._lock:
                self._served -= 1

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest, (t0, peer, _) = next(iter(self._pending.items()))
            if now - t0 < self.first_line_s:
                return
            self.on_reject("first_line_timeout", peer)
            self._drop(oldest)

    def _forget(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        _close(conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        conn.close()


def listen(bind: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on `bind`:`port` with a backlog deep enough that a burst of connections waits in
    the kernel rather than being refused."""
    return socket.create_server((bind, port), backlog=1024)

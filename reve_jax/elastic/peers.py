"""Snapshot traffic between the hosts of a group: a process pushes each of its snapshot sets to its ring
successor, and a restoring process fetches the pieces it lacks from the host that holds them.

Every message is a line signed under the snapshot channel's keys (auth.keys: one for requests, one for
replies, both derived from the run's secret; the body carries a random nonce that the reply echoes) followed by
a payload whose size the line declares and whose SHA-256 it (or the pushed manifest, itself signed under the
run's snapshot key) names. A connection is served only once its first line proves it holds the secret, within
a few seconds (gate.py): a flood of idle or dripping connections cannot keep a push out. A server only answers
requests of its own group (`attempt`): a worker of a group the supervisor gave up on can neither push stale
state into the new group's stores nor read from them. Sizes are checked before anything is read: a push must be
exactly as large as the pusher's pieces are under the group's layout, a reply as large as the pieces asked for.
Every piece served or received is checked against its digest (snapstore.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable

from reve_jax.elastic import auth, gate
from reve_jax.elastic.snapstore import MAX_MANIFEST, HostStore, SetDamaged, SetId

log = logging.getLogger("reve_jax")

CHANNEL = "snapshot"  # the name under which the channel's keys are derived from the run's secret (auth.keys)
TIMEOUT_S = 60.0  # per read or write of an authenticated connection (a push of a large set streams for a while)
MAX_CONNECTIONS = 32  # authenticated connections served at once (pushes from the predecessor, fetches while restoring)


class PeerError(RuntimeError):
    """A peer refused a request, answered wrongly, or could not be reached."""


def facing_address(coordinator: str) -> str:
    """This host's address on the route to the coordinator (what the group's other hosts reach): the source
    address the kernel picks for it. 127.0.0.1 without one."""
    host = coordinator.rpartition(":")[0].strip("[]") if coordinator else ""
    if not host:
        return "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]
    return "127.0.0.1"


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ConnectionError(f"short read: {len(data)} of {n} bytes")
    return data


class PeerServer:
    """Serves this host's store to the group (`attempt`): accepts pushes, answers manifest and piece requests.
    `push_size(owner, n)` is the exact data size a push from `owner` may have (None: refuse)."""

    def __init__(
        self, store: HostStore, secret: bytes, attempt: int, bind: str, push_size: Callable[[int, int], int | None]
    ):
        self.store, self.attempt = store, attempt
        self._request_key, self._reply_key = auth.keys(secret, CHANNEL)
        self.push_size = push_size
        self.sock = gate.listen(bind)
        self.address = f"{bind}:{self.sock.getsockname()[1]}"
        self.rejected: Counter = Counter()
        self.receive_cpu_s: list[float] = []  # CPU seconds of each accepted push
        self._newest: dict[int, int] = {}  # owner -> newest step pushed (older pushes are replays)
        self._gate = gate.Gate(
            self.sock,
            lambda line: auth.verify(self._request_key, line),
            self._serve,
            lambda reason, peer: self.rejected.update([reason]),
            max_pending=64,
            max_served=MAX_CONNECTIONS,
            name="snapshot-peer-server",
        ).start()

    def _serve(self, conn: socket.socket, msg: dict, peer: str):
        conn.settimeout(TIMEOUT_S)
        with contextlib.suppress(OSError), conn.makefile("rb") as f:
            try:
                payload = self._answer(msg, f, conn)
                self._reply(conn, msg, True, payload)
            except (PeerError, OSError, ValueError, KeyError) as e:  # SetDamaged is a ValueError
                self.rejected[type(e).__name__] += 1
                with contextlib.suppress(OSError):
                    self._reply(conn, msg, False, error=str(e)[:300])

    def _answer(self, msg: dict, f, conn) -> bytes:
        if msg.get("attempt") != self.attempt:
            raise PeerError(f"request of group {msg.get('attempt')} refused by group {self.attempt}")
        op = msg.get("op")
        sid = SetId.parse(str(msg.get("set", "")))
        if sid is None:
            raise PeerError("no set named")
        if op == "push":
            return self._take_push(sid, msg, f, conn)
        if op == "manifest":
            self.store.manifest(sid)  # a damaged one is refused here, not only by the peer
            return self.store.manifest_bytes(sid)
        if op == "fetch":
            entries = self.store.manifest(sid)["pieces"]
            return b"".join(self.store.read(sid, [entries[int(k)] for k in msg["pieces"]]))
        raise PeerError(f"unknown op {op!r}")

    def _take_push(self, sid: SetId, msg: dict, f, conn) -> bytes:
        want = self.push_size(sid.owner, sid.n)
        size, mlen = int(msg["size"]), int(msg["manifest_size"])
        if sid.attempt != self.attempt or want is None or size != want or not 0 < mlen <= MAX_MANIFEST:
            raise PeerError(f"push of {sid.name} with {size} bytes refused (expected {want})")
        if sid.step <= self._newest.get(sid.owner, -1):
            raise PeerError(f"push of {sid.name}: step {sid.step} is not newer than {self._newest[sid.owner]}")
        self._reply(conn, msg, True)  # go ahead: nothing is sent before the header is accepted
        cpu0 = time.thread_time()
        manifest = _read_exact(f, mlen)
        if hashlib.sha256(manifest).hexdigest() != msg["manifest_sha256"]:
            raise PeerError("manifest digest mismatch")
        try:
            tmp = self.store.receive(sid, manifest, f, size)
        except SetDamaged as e:
            raise PeerError(str(e)) from None
        self.store.commit(tmp, sid)
        self._newest[sid.owner] = sid.step
        self.receive_cpu_s.append(time.thread_time() - cpu0)
        return b""

    def _reply(self, conn, msg: dict, ok: bool, payload: bytes = b"", error: str = ""):
        digest = hashlib.sha256(payload).hexdigest()
        head = {"nonce": msg.get("nonce"), "ok": ok, "size": len(payload), "sha256": digest}
        if error:
            head["error"] = error
        conn.sendall(auth.sign(self._reply_key, head) + payload)

    def close(self):
        self._gate.close()


def call(
    address: str, secret: bytes, msg: dict, parts=(), max_reply: int = MAX_MANIFEST, timeout: float = TIMEOUT_S
) -> bytes:
    """Sends `msg` (signed, with a fresh nonce) and the byte `parts` after it; returns the reply's payload.
    Raises PeerError when the peer refuses or its reply is not signed, not for this request, or too big."""
    msg = dict(msg, nonce=os.urandom(8).hex())
    request_key, reply_key = auth.keys(secret, CHANNEL)
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(auth.sign(request_key, msg))
            with s.makefile("rb") as f:
                if parts:  # the payload goes only once the header is accepted
                    _check_reply(address, reply_key, msg, f)
                    for part in parts:
                        s.sendall(part)
                reply = _check_reply(address, reply_key, msg, f)
                size = int(reply["size"])
                if size > max_reply:
                    raise PeerError(f"{address} answered {size} bytes, at most {max_reply} expected")
                data = _read_exact(f, size)
    except (OSError, auth.Rejected) as e:
        raise PeerError(f"{msg['op']} to {address}: {type(e).__name__}: {e}") from e
    if hashlib.sha256(data).hexdigest() != reply["sha256"]:
        raise PeerError(f"{address}: reply digest mismatch")
    return data


def _check_reply(address: str, reply_key: bytes, msg: dict, f) -> dict:
    reply = auth.verify(reply_key, f.readline(auth.MAX_LINE + 1))
    if reply.get("nonce") != msg["nonce"]:
        raise PeerError("reply is not for this request")
    if not reply.get("ok"):
        raise PeerError(f"{address} refused {msg['op']}: {reply.get('error', '')}")
    return reply


def push(address: str, secret: bytes, store: HostStore, sid: SetId, timeout: float = TIMEOUT_S) -> None:
    """Sends set `sid` of `store` to the peer at `address`, streamed from the store's files."""
    manifest = store.manifest_bytes(sid)
    data_path = store.root / sid.name / "data.bin"
    size = os.path.getsize(data_path)

    def chunks():
        yield manifest
        with open(data_path, "rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    msg = {
        "op": "push",
        "attempt": sid.attempt,
        "set": sid.name,
        "size": size,
        "manifest_size": len(manifest),
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
    }
    call(address, secret, msg, chunks(), max_reply=0, timeout=timeout)  # a generator: true even when the set is empty

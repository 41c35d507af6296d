"""Proof that a control-channel message comes from this run: HMAC-SHA256 under a per-run secret.

The supervisor draws a fresh 32-byte secret per run and hands it to its workers out of band: in the environment
of a local process (REVE_SECRET, hex), or as the first line on the standard input of the ssh / srun command
that starts a remote one (so it never appears on a command line, where `ps` on either end would show it). The
worker takes it out of its environment once read, so processes it starts do not inherit it. It is never
written to events.jsonl or a log.

A line on the wire is `<64 hex digits of HMAC-SHA256(key, body)> <body>\\n`, body a JSON object. Each client
puts a random session id and a counter in every body and the server refuses a counter it has already seen for
that session, so a recorded beat cannot be replayed to keep a dead host looking alive. Replies echo the counter,
so a stop request cannot be forged or replayed either.

The secret itself signs nothing: each use gets its own key derived from it (`keys(secret, channel)`), one for
requests and one for replies, per channel ("heartbeat", "snapshot"). A line signed for one direction or channel
does not verify in another, so a man in the middle cannot reflect a worker's own beat back to it as the
supervisor's reply, nor replay a snapshot request on the heartbeat port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets

MAX_LINE = 16 * 1024  # a beat is ~300 bytes; anything longer is refused unread
SECRET_ENV = "REVE_SECRET"
_MAC_LEN = 64  # hex digits of SHA-256


class Rejected(ValueError):
    """A message that did not prove it came from this run; `reason` is the counter it is reported under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def derive(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one `purpose` (e.g. "heartbeat/request"), derived from the run's secret with
    HMAC-SHA256 as a pseudo-random function: knowing one purpose's key says nothing about another's."""
    return hmac.new(secret, b"reve_jax/" + purpose.encode(), hashlib.sha256).digest()


def keys(secret: bytes, channel: str) -> tuple[bytes, bytes]:
    """(request key, reply key) of `channel`: clients sign with the first, servers with the second."""
    return derive(secret, f"{channel}/request"), derive(secret, f"{channel}/reply")


def sign(key: bytes, msg: dict) -> bytes:
    """Returns the wire line for `msg`: its MAC under `key`, a space, its JSON, a newline."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return mac + b" " + body + b"\n"


def verify(key: bytes, line: bytes, max_len: int = MAX_LINE) -> dict:
    """Returns the message of a wire line whose MAC under `key` is right; raises Rejected("oversized" | "bad_mac" |
    "malformed") otherwise. `max_len`: the longest line accepted (a snapshot manifest is longer than a beat)."""
    if len(line) > max_len or not line.endswith(b"\n"):
        raise Rejected("oversized")
    mac, _, body = line.rstrip(b"\n").partition(b" ")
    want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, want):
        raise Rejected("bad_mac")
    try:
        msg = json.loads(body)
    except ValueError:
        raise Rejected("malformed") from None
    if not isinstance(msg, dict):
        raise Rejected("malformed")
    return msg


def secret_from_env(env) -> bytes | None:
    """Returns the run's secret from `env` (REVE_SECRET, hex) and removes it there, or None if absent."""
    value = env.pop(SECRET_ENV, None)
    if not value:
        return None
    try:
        return bytes.fromhex(value.strip())
    except ValueError:
        raise ValueError(f"{SECRET_ENV} is not hex") from None


def session_id() -> str:
    return os.urandom(8).hex()

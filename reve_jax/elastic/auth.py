"""Proof that a control-channel message comes from this run: HMAC-SHA256 under a per-run secret.

The supervisor draws a fresh 32-byte secret per run and hands it to its workers out of band: in the environment
of a local process (REVE_SECRET, hex), or as the first line on the standard input of the ssh / srun command
that starts a remote one (so it never appears on a command line, where `ps` on either end would show it). The
worker takes it out of its environment once read, so processes it starts do not inherit it. It is never
written to events.jsonl or a log.

A line on the wire is `<64 hex digits of HMAC-SHA256(secret, body)> <body>\\n`, body a JSON object. Each client
puts a random session id and a counter in every body and the server refuses a counter it has already seen for
that session, so a recorded beat cannot be replayed to keep a dead host looking alive. Replies are signed the
same way and echo the counter, so a stop request cannot be forged or replayed either.
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


def sign(secret: bytes, msg: dict) -> bytes:
    """Returns the wire line for `msg`: its MAC, a space, its JSON, a newline."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    mac = hmac.new(secret, body, hashlib.sha256).hexdigest().encode()
    return mac + b" " + body + b"\n"


def verify(secret: bytes, line: bytes) -> dict:
    """Returns the message of a wire line whose MAC is right; raises Rejected("oversized" | "bad_mac" |
    "malformed") otherwise."""
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise Rejected("oversized")
    mac, _, body = line.rstrip(b"\n").partition(b" ")
    want = hmac.new(secret, body, hashlib.sha256).hexdigest().encode()
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

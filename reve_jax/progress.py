"""Progress lines for long phases outside the trainer's bar (the autoencoder's and the feature net's training,
sampling an evaluation's images): one log line at most every ~30 s and one at the end, so a log read later still
shows that the phase was alive and how fast it went."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

_log = logging.getLogger("reve_jax")


class Progress:
    """`p = Progress("autoencoder", total)`; `p(done, "mse 0.01")` after each unit of work logs
    "autoencoder 120/3000 (4.0%, 2.1/s, 23 min left): mse 0.01" when `seconds` have passed since the last line, and
    always at `done == total`. `start`: the units done before (a resumed job), left out of the rate. `log` and `clock`
    are for tests."""

    def __init__(
        self,
        what: str,
        total: int,
        *,
        seconds: float = 30.0,
        start: int = 0,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.total, self.seconds, self.start = what, max(int(total), 1), seconds, start
        self.log = log or _log.info
        self.clock = clock
        self.t0 = self.last = clock()

    def __call__(self, done: int, note: str | Callable[[], str] = "") -> bool:
        """Returns whether a line was logged. `note` may be a function, called only for a line (reading a device
        value for it would otherwise wait for the device at every step)."""
        now = self.clock()
        if now - self.last < self.seconds and done < self.total:
            return False
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        eta = f"{left / 60:.0f} min left" if left >= 90 else f"{left:.0f} s left"
        line = f"{self.what} {done}/{self.total} ({100 * done / self.total:.1f}%, {rate:.3g}/s, {eta})"
        note = note() if callable(note) else note
        self.log(line + (f": {note}" if note else ""))
        return True

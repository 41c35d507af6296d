"""Orbax's own reports of a failed checkpoint write, held back so that the failure is reported once.

A write that fails (a full disk) makes Orbax's threads log the error with tracebacks (the absl logger), asyncio
report "Future exception was never retrieved" for pending chunks, tensorstore call back into closed event loops
("Event loop is closed", through sys.unraisablehook) and, at exit, the abandoned write coroutines complain.
While a save or restore of a watched directory is in flight, error records that mention the directory and those
unraisables are held; if the operation succeeds they are replayed unchanged, if it fails they are dropped
(CheckpointSaveError or the restore error reports it), as is later noise about the failed step (and, after a
failure, the unraisables and Orbax's own error records that name no path: an OSError such as "[Errno 28] No space
left on device" raised by a metadata write names no file). Anything else passes through.

Use: `w = watch(directory)` once per Checkpointer; `w.begin()` before each save or restore, `w.end(ok, step)`
when its outcome is known, `w.close()` with the Checkpointer.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from pathlib import Path


class Watch:
    """One Checkpointer's share of `NoiseFilter`: whether an operation on its directory is in flight (its noise
    is held), and which steps failed and were reported (their noise is dropped from then on)."""

    def __init__(self, hub: NoiseFilter, directory: Path):
        self.hub, self.directory = hub, str(directory)
        self.steps_named = re.compile(re.escape(self.directory) + r"/(\d+)(?![\d])")
        self.active = 0  # operations in flight
        self.failed: set[int] = set()
        self.held: list[tuple[str, object]] = []

    def begin(self):
        with self.hub.lock:
            self.active += 1

    def end(self, ok: bool, step: int | None = None):
        """The operation (on `step`) finished: replay what was held if it succeeded, else drop it (its error
        says it once) and drop what comes later about that step: late callbacks of the abandoned work."""
        with self.hub.lock:
            held, self.held = self.held, []
            self.active = max(0, self.active - 1)
            if not ok:
                self.failed.add(-1 if step is None else step)
        if ok:
            for kind, item in held:
                self.hub.replay(kind, item)

    def first_error(self) -> str | None:
        """The first held log line (Orbax's own message), for a save that failed without raising."""
        for kind, item in self.held:
            if kind == "log":
                return item.getMessage().splitlines()[0][:300]
        return None

    def close(self):
        if not self.failed:  # after a failure, keep dropping the abandoned work's noise until exit
            self.hub.remove(self)


def _in_orbax(filename: str | None) -> bool:
    """Whether a source file (a log record's caller, a coroutine's code) is Orbax's own."""
    return f"{os.sep}orbax{os.sep}" in (filename or "")


class NoiseFilter:
    """The process's filter: a logging.Filter on the absl and asyncio loggers and the sys.unraisablehook.
    One per process (the hooks are process-wide), installed by the first `watch`."""

    LOGGERS = ("absl", "asyncio")

    def __init__(self):
        self.lock = threading.RLock()  # GC may run a finalizer (and this hook) while the lock is held
        self.watches: list[Watch] = []
        self.previous_hook = None

    def watch(self, directory: Path) -> Watch:
        with self.lock:
            if self.previous_hook is None:
                self.previous_hook = sys.unraisablehook
                sys.unraisablehook = self.unraisable
                for name in self.LOGGERS:
                    logging.getLogger(name).addFilter(self)
            w = Watch(self, directory)
            self.watches.append(w)
            return w

    def remove(self, w: Watch):
        with self.lock:
            if w in self.watches:
                self.watches.remove(w)

    def _claim(self, text: str, orbax_noise: bool, kind: str, item) -> bool:
        """Hold or drop `item` when it belongs to a watched operation; False lets it through."""
        with self.lock:
            mine = [w for w in self.watches if w.directory in text]
            if not mine and orbax_noise:
                # It names no path. After a failure it is the abandoned work's (callbacks arrive late, even while
                # the next operation runs); else it belongs to what is in flight.
                if any(w.failed for w in self.watches):
                    return True
                mine = [w for w in self.watches if w.active]
            for w in mine:
                if w.failed.intersection(int(n) for n in w.steps_named.findall(text)):
                    return True  # about a step whose failure was reported
                if w.active:
                    w.held.append((kind, item))
                    return True
                if w.failed:
                    return True
        return False

    def filter(self, record: logging.LogRecord) -> bool:
        """logging.Filter protocol, on the absl and asyncio loggers: only ERROR records are considered."""
        if record.levelno < logging.ERROR or not self.watches or getattr(record, "reve_replayed", False):
            return True
        try:
            text = record.getMessage()
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
            orbax_noise = _in_orbax(record.pathname)  # logged by Orbax itself
        except Exception:
            return True
        return not self._claim(text, orbax_noise, "log", record)

    def unraisable(self, u):
        try:
            exc, obj = u.exc_value, u.object
            code = getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
            orbax_noise = (isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)) or (
                code is not None and _in_orbax(code.co_filename)
            )
            claimed = bool(self.watches) and self._claim(f"{exc} {u.err_msg}", orbax_noise, "unraisable", u)
        except Exception:  # at interpreter exit almost anything can fail; never lose the report then
            claimed = False
        if not claimed:
            self.previous_hook(u)

    def replay(self, kind: str, item):
        if kind == "log":
            item.reve_replayed = True  # passes this filter now
            logging.getLogger(item.name).handle(item)
        else:
            self.previous_hook(item)


_FILTER = NoiseFilter()


def watch(directory: Path) -> Watch:
    """Starts watching `directory` (a Checkpointer's checkpoints/) on the process's filter."""
    return _FILTER.watch(directory)

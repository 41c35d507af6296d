"""Fencing: once the supervisor has given up on a group, no process of it writes to the run's directory again.

A partitioned host's worker may still run when the next group starts (nobody could reach it to kill it). The
supervisor writes the number of the oldest group still allowed to write to `<workdir>/.fence` (atomically)
before it launches a group, and as soon as it decides to kill one. A worker of group `attempt` is fenced once
that number exceeds `attempt`. Three things stop it, whichever comes first:

1. every write its Python code opens under the workdir (open for writing, rename, remove, mkdir, rmtree,
   truncate) first reads the fence: a fenced process exits there (code 75) before the write happens. This is
   a Python audit hook, so it covers the trainer, Orbax's metadata, its commit (the rename of the temporary
   checkpoint directory) and its clean-up of old checkpoints without their cooperation;
2. a thread re-reads the fence every 0.5 s and exits the process when fenced (a stopped or partitioned
   process that comes back exits within that);
3. the supervisor's heartbeat reply says "fenced" (a reachable process exits at its next beat).

Not covered: bytes written through a file descriptor opened before the fence moved (TensorStore's array
chunks, a TensorBoard event file held open) — they land in an uncommitted temporary checkpoint directory or
the writer's own event file, never in a committed checkpoint or metrics.jsonl. On NFS the fence is seen after
the attribute cache expires (a few seconds).
"""

from __future__ import annotations

import os
import sys
import threading

FENCE_FILE = ".fence"
EXIT_FENCED = 75  # EX_TEMPFAIL: this group was superseded, nothing is wrong with the host
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {  # audit event -> positions of the paths it changes
    "os.rename": (0, 1),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.truncate": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "shutil.rmtree": (0,),
    "shutil.move": (0, 1),
    "shutil.copyfile": (1,),
}


def write_fence(workdir: str, attempt: int) -> None:
    """Allows writes from groups numbered `attempt` and later only (atomic replace; the supervisor's side)."""
    path = os.path.join(workdir, FENCE_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{attempt}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_fence(workdir: str) -> int:
    """Returns the oldest group allowed to write (-1 when no fence was written)."""
    try:
        fd = os.open(os.path.join(workdir, FENCE_FILE), os.O_RDONLY)  # read-only: passes our own hook
    except OSError:
        return -1
    try:
        return int(os.read(fd, 64).decode().strip() or -1)
    except ValueError:
        return -1
    finally:
        os.close(fd)


class Fence:
    """The worker's side for group `attempt` writing under `workdir`."""

    def __init__(self, workdir: str, attempt: int, poll_s: float = 0.5):
        self.workdir = os.path.abspath(workdir)
        self.attempt, self.poll_s = attempt, poll_s
        self._prefix = self.workdir.rstrip(os.sep) + os.sep
        self._closing = threading.Event()

    def fenced(self) -> bool:
        """True once a later group owns the run directory."""
        return read_fence(self.workdir) > self.attempt

    def exit_fenced(self, why: str) -> None:
        """Ends the process at once: no clean-up code (which could write) runs."""
        os.write(2, f"fence: group {self.attempt} superseded ({why}); exiting without writing\n".encode())
        os._exit(EXIT_FENCED)

    def install(self) -> Fence:
        """Starts the audit hook and the watcher thread (for the life of the process: audit hooks cannot be
        removed)."""
        sys.addaudithook(self._audit)
        threading.Thread(target=self._watch, name="fence-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._closing.wait(self.poll_s):
            if self.fenced():
                self.exit_fenced("fence file")

    def _audit(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
            paths = (path,) if writes else ()
        else:
            positions = _PATH_EVENTS.get(event)
            if positions is None:
                return
            paths = tuple(args[i] for i in positions if i < len(args))
        if any(self._inside(p) for p in paths) and self.fenced():
            self.exit_fenced(f"{event} {paths[0]!r}")

    def _inside(self, path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        return os.path.abspath(path).startswith(self._prefix)

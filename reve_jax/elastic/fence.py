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

The same guard covers other directories the process writes for the run (`Fence.guard`: the run's in-memory
snapshots on the host, snapshot.py), so a superseded process writes no snapshot set either.

The fence fails closed: when it exists but cannot be read (EACCES, EIO, ESTALE, garbage in it) a worker cannot
prove that it may write, so the write is refused (PermissionError, with the cause) and `fenced()` is True; the
supervisor refuses to start (it must know which groups are fenced off before it numbers the next one). Only a
missing fence (ENOENT: no group was ever fenced off) reads as "everyone may write".

Not covered: bytes written through a file descriptor opened before the fence moved (TensorStore's array
chunks, a TensorBoard event file held open) — they land in an uncommitted temporary checkpoint directory or
the writer's own event file, never in a committed checkpoint or metrics.jsonl. On NFS the fence is seen after
the attribute cache expires (a few seconds).
"""

from __future__ import annotations

import contextlib
import errno
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


class FenceUnreadable(OSError):
    """The fence exists (or may) but cannot be read: nobody can tell which groups may write."""


def read_fence(workdir: str) -> int:
    """Returns the oldest group allowed to write; -1 when no fence was ever written (the file does not exist).
    Raises FenceUnreadable for anything else that keeps it from being read (EACCES, EIO, ESTALE, not a number)."""
    path = os.path.join(workdir, FENCE_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)  # read-only: passes our own hook
    except FileNotFoundError:
        return -1
    except OSError as e:
        raise FenceUnreadable(e.errno, f"cannot read the fence {path}: {e.strerror}") from e
    try:
        data = os.read(fd, 64)
    except OSError as e:
        raise FenceUnreadable(e.errno, f"cannot read the fence {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    try:
        return int(data.decode().strip())
    except (ValueError, UnicodeDecodeError):
        raise FenceUnreadable(errno.EINVAL, f"the fence {path} holds {data[:32]!r}, not a group number") from None


def _write_quietly(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, data)


class Fence:
    """The worker's side for group `attempt` writing under `workdir`."""

    def __init__(self, workdir: str, attempt: int, poll_s: float = 0.5):
        self.workdir = os.path.abspath(workdir)
        self.attempt, self.poll_s = attempt, poll_s
        self._prefixes = (self.workdir.rstrip(os.sep) + os.sep,)
        self._closing = threading.Event()

    def guard(self, path: str) -> Fence:
        """Fences writes under `path` too (a directory the run writes outside the run directory)."""
        self._prefixes += (os.path.abspath(path).rstrip(os.sep) + os.sep,)
        return self

    def fenced(self) -> bool:
        """True once a later group owns the run directory, or when the fence cannot be read (fail closed)."""
        try:
            return read_fence(self.workdir) > self.attempt
        except FenceUnreadable:
            return True

    def exit_fenced(self, why: str) -> None:
        """Ends the process at once: no clean-up code (which could write) runs. The farewell line is written from
        a thread given half a second: a cut-off host's stderr is an ssh session nobody drains any more, where a
        write blocks (or fails once the session is gone), and the process must end all the same."""
        line = f"fence: group {self.attempt} superseded ({why}); exiting without writing\n".encode()
        writer = threading.Thread(target=_write_quietly, args=(2, line), daemon=True)
        writer.start()
        writer.join(timeout=0.5)
        os._exit(EXIT_FENCED)

    def install(self) -> Fence:
        """Starts the audit hook and the watcher thread (for the life of the process: audit hooks cannot be
        removed)."""
        sys.addaudithook(self._audit)
        threading.Thread(target=self._watch, name="fence-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self._closing.wait(self.poll_s):
            try:
                fenced = read_fence(self.workdir) > self.attempt
            except FenceUnreadable:
                continue  # writes are refused meanwhile (the hook); a file system that comes back decides
            if fenced:
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
        if not any(self._inside(p) for p in paths):
            return
        try:
            fenced = read_fence(self.workdir) > self.attempt
        except FenceUnreadable as e:  # fail closed: this process cannot prove the run is still its group's
            raise PermissionError(e.errno, f"{e}; refusing {event} of {paths[0]!r} (fence.py)") from None
        if fenced:
            self.exit_fenced(f"{event} {paths[0]!r}")

    def _inside(self, path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        return os.path.abspath(path).startswith(self._prefixes)

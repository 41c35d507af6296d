"""A host's store of train-state snapshots: files in a host-local directory, by default on /dev/shm (host
memory), so they outlive the worker process that wrote them (the supervisor SIGKILLs a whole group on a
failure) but not the host.

One *set* per (group attempt, step, owner process, group size): the pieces one process of that group owned
(shards.py), as `data.bin` (the pieces' bytes, back to back) and `manifest.json` (each piece's leaf, box,
offset, size and SHA-256; the state's leaf paths, shapes and dtypes; the run's metadata at that step). A host
holds the sets its own process wrote and the sets its ring predecessor pushed to it (peers.py). A set is written
into a temporary directory and renamed into place, so a reader never sees half of one.

Who can touch it. The sets are the model's weights in clear, on a path every user of the host can name, so:
- the root is private to its user (`private_root`): made 0700, and an existing one is used only if `lstat` says
  it is a directory (not a symlink) owned by this user with no group/other bits, in a parent where nobody else
  can rename it away; the default root is per user (`/dev/shm/reve_jax-<uid>`), so another user who makes a
  directory of that name first cannot take ours. Every file is created 0600 (O_EXCL, O_NOFOLLOW);
- the manifest is signed (HMAC-SHA256 under the run's snapshot key), and each piece's digest is in it: every
  read, local or for a peer, checks the bytes it returns (`SetDamaged` otherwise), so a set altered in place is
  never restored;
- a write that fails (a full /dev/shm) removes its temporary directory before it raises, and a temporary
  directory whose writer is gone (killed mid-write: its pid no longer runs, or runs another program) is removed
  when the store is next opened or pruned: a full /dev/shm does not stay full (NCCL and other users need it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path

import numpy as np

from reve_jax.elastic import auth

_SET = re.compile(r"^a(\d+)_s(\d+)_p(\d+)of(\d+)$")
_TMP = re.compile(r"^\.tmp_.*_(\d+)_(\d+)_\d+$")  # .tmp_<set>_<pid>_<its start time>_<thread>
MAX_MANIFEST = 64 << 20
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class StoreNotPrivate(RuntimeError):
    """The snapshot root exists but others could read or replace what is in it."""


class SetDamaged(ValueError):
    """A set whose manifest fails its MAC or whose bytes fail their digest: altered or torn, never restored."""


@dataclasses.dataclass(frozen=True, order=True)
class SetId:
    step: int
    attempt: int
    owner: int
    n: int  # processes in the group that wrote it

    @property
    def name(self) -> str:
        return f"a{self.attempt:06d}_s{self.step:012d}_p{self.owner:05d}of{self.n:05d}"

    @classmethod
    def parse(cls, name: str) -> SetId | None:
        m = _SET.match(name)
        if m is None:
            return None
        a, s, p, n = map(int, m.groups())
        return cls(s, a, p, n)


def default_root() -> Path:
    """This user's directory in host memory where there is a tmpfs for it, else in the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"reve_jax-{os.geteuid()}"


def private_root(path) -> Path:
    """Makes `path` a directory only this user can use (mode 0700), or checks that the existing one is; returns
    it. Raises StoreNotPrivate, saying why and what to do, when it is a symlink or not a directory, belongs to
    another user, has group/other permission bits, or sits in a directory others may write without the sticky
    bit (they could rename it and put their own in its place)."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st, me = os.lstat(path), os.geteuid()
    why = ""
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid != me:
        why = f"it is owned by uid {st.st_uid}, and this process runs as uid {me}"
    elif st.st_mode & 0o077:
        why = f"it has group/other permissions ({stat.filemode(st.st_mode)}); `chmod 700 {path}` if it is yours"
    else:
        parent = os.stat(path.parent)
        if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
            why = f"its parent {path.parent} is writable by others without the sticky bit"
    if why:
        raise StoreNotPrivate(
            f"snapshot directory {path} is not private: {why}. It would hold the train state where another user "
            f"could read or replace it. Remove it (ask its owner if it is not yours) or set "
            f"--config.elastic.snapshot_dir to a directory only you can use."
        )
    return path


def _mkdirs(path: Path) -> None:
    """Each missing directory of `path` made 0700 (Path.mkdir gives parents the umask's mode)."""
    if path.is_dir():
        return
    _mkdirs(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def _start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of process `pid`, None when it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_ME = _start_time(os.getpid()) or 0


class HostStore:
    """The sets under `root` (`<snapshot root>/<run>/<host>`), manifests signed under `key` (the run's snapshot
    key). Thread-safe within a process."""

    def __init__(self, root: str | Path, key: bytes):
        self.root = Path(root)
        self.key = key
        _mkdirs(self.root)
        self._lock = threading.Lock()
        self.clean_stale()

    # ------------------------------------------------------------ writing
    def _tmp(self, sid: SetId) -> Path:
        tmp = self.root / f".tmp_{sid.name}_{os.getpid()}_{_ME}_{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, 0o700)
        return tmp

    def _commit(self, tmp: Path, sid: SetId) -> None:
        final = self.root / sid.name
        with self._lock:
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)

    @staticmethod
    def _write_manifest(tmp: Path, signed: bytes) -> None:
        with os.fdopen(os.open(tmp / "manifest.json", _CREATE, 0o600), "wb") as f:
            f.write(signed)

    def write(self, sid: SetId, manifest: dict, arrays: list[np.ndarray]) -> None:
        """Stores this process's pieces (`arrays`, in the manifest's order; offsets, sizes and digests are filled
        in here). On any error the temporary directory is removed before the error propagates."""
        tmp = self._tmp(sid)
        try:
            entries, offset = [], 0
            with os.fdopen(os.open(tmp / "data.bin", _CREATE, 0o600), "wb") as f:
                for entry, a in zip(manifest["pieces"], arrays, strict=True):
                    buf = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                    f.write(buf)
                    entries.append([*entry[:2], offset, buf.nbytes, hashlib.sha256(buf).hexdigest()])
                    offset += buf.nbytes
            self._write_manifest(tmp, auth.sign(self.key, dict(manifest, pieces=entries)))
            self._commit(tmp, sid)
        except BaseException:
            self.discard(tmp)
            raise

    def receive(self, sid: SetId, manifest: bytes, stream, size: int) -> Path:
        """Writes a set pushed by a peer into a temporary directory: `manifest` (the signed bytes, checked here),
        then `size` data bytes read from `stream` (a file-like with `read`), each piece checked against its digest
        on the way. Returns the directory to `commit`; raises SetDamaged (a wrong MAC, layout or digest) or
        ConnectionError (a short read), having removed it."""
        entries = self.parse_manifest(manifest)["pieces"]
        if [e[2] for e in entries] != [sum(e[3] for e in entries[:i]) for i in range(len(entries))]:
            raise SetDamaged(f"{sid.name}: pieces are not back to back")
        if sum(e[3] for e in entries) != size:
            raise SetDamaged(f"{sid.name}: {size} data bytes announced, the manifest says otherwise")
        tmp = self._tmp(sid)
        try:
            self._write_manifest(tmp, manifest)
            with os.fdopen(os.open(tmp / "data.bin", _CREATE, 0o600), "wb") as f:
                for entry in entries:
                    digest, left = hashlib.sha256(), entry[3]
                    while left:
                        chunk = stream.read(min(left, 1 << 20))
                        if not chunk:
                            raise ConnectionError(f"peer closed {left} bytes short of piece at {entry[2]}")
                        digest.update(chunk)
                        f.write(chunk)
                        left -= len(chunk)
                    if digest.hexdigest() != entry[4]:
                        raise SetDamaged(f"{sid.name}: data digest mismatch in the piece at offset {entry[2]}")
            return tmp
        except BaseException:
            self.discard(tmp)
            raise

    def commit(self, tmp: Path, sid: SetId) -> None:
        self._commit(tmp, sid)

    @staticmethod
    def discard(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------ reading
    def sets(self) -> list[SetId]:
        """Complete sets held here, oldest step first."""
        if not self.root.is_dir():
            return []
        out = [SetId.parse(p.name) for p in self.root.iterdir()]
        return sorted(s for s in out if s is not None and (self.root / s.name / "manifest.json").is_file())

    def manifest_bytes(self, sid: SetId) -> bytes:
        """The manifest as stored (signed): what a peer is sent; it checks the MAC itself."""
        return (self.root / sid.name / "manifest.json").read_bytes()

    def parse_manifest(self, raw: bytes) -> dict:
        """The manifest of signed bytes `raw` (this store's or a peer's); SetDamaged if the MAC is wrong."""
        try:
            return auth.verify(self.key, raw, max_len=MAX_MANIFEST)
        except auth.Rejected as e:
            raise SetDamaged(f"manifest refused ({e.reason}): altered, torn, or of another run") from None

    def manifest(self, sid: SetId) -> dict:
        return self.parse_manifest(self.manifest_bytes(sid))

    def read(self, sid: SetId, entries: list[list]) -> list[bytes]:
        """The bytes of manifest piece entries [leaf, box, offset, nbytes, sha256] (from a checked manifest);
        SetDamaged when a piece is short or its digest is wrong."""
        out = []
        with open(self.root / sid.name / "data.bin", "rb") as f:
            for entry in entries:
                offset, nbytes = entry[2], entry[3]
                f.seek(offset)
                data = f.read(nbytes)
                check_piece(sid, entry, data)
                out.append(data)
        return out

    # ------------------------------------------------------------ keeping it small
    def prune(self, attempt: int, keep: int = 2) -> None:
        """Keeps the newest `keep` steps of each (attempt, owner), drops sets of other attempts that the current
        `attempt` has overtaken (a step at or below the newest one this attempt holds here), and removes what
        writers that are gone left behind."""
        held = self.sets()
        newest = max((s.step for s in held if s.attempt == attempt), default=None)
        by_owner: dict[tuple[int, int], list[SetId]] = {}
        for s in held:
            by_owner.setdefault((s.attempt, s.owner), []).append(s)
        drop = [s for group in by_owner.values() for s in sorted(group)[:-keep]]
        if newest is not None:
            drop += [s for s in held if s.attempt != attempt and s.step <= newest]
        with self._lock:
            for s in set(drop):
                shutil.rmtree(self.root / s.name, ignore_errors=True)
        self.clean_stale()

    def clean_stale(self) -> None:
        """Removes temporary directories whose writer no longer runs (killed mid-write)."""
        with contextlib.suppress(OSError):
            for tmp in self.root.iterdir():
                m = _TMP.match(tmp.name)
                if m is None:
                    if tmp.name.startswith(".tmp_") and time.time() - tmp.lstat().st_mtime > 600:
                        shutil.rmtree(tmp, ignore_errors=True)  # named by another version: by age only
                    continue
                pid, started = int(m.group(1)), int(m.group(2))
                if _start_time(pid) != started:  # gone, or its pid now belongs to another process
                    shutil.rmtree(tmp, ignore_errors=True)

    def clear(self) -> None:
        with self._lock:
            shutil.rmtree(self.root, ignore_errors=True)
            _mkdirs(self.root)


def check_piece(sid: SetId, entry: list, data: bytes) -> None:
    """Raises SetDamaged unless `data` is the piece manifest `entry` describes (size and SHA-256)."""
    if len(data) != entry[3]:
        raise SetDamaged(f"{sid.name}: piece at {entry[2]} is short ({len(data)} of {entry[3]} bytes)")
    if len(entry) < 5 or hashlib.sha256(data).hexdigest() != entry[4]:
        raise SetDamaged(f"{sid.name}: data digest mismatch in the piece at offset {entry[2]}")

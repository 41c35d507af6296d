"""A host's store of train-state snapshots: files in a host-local directory, by default on /dev/shm (host
memory), so they outlive the worker process that wrote them (the supervisor SIGKILLs a whole group on a
failure) but not the host.

One *set* per (group attempt, step, owner process, group size): the pieces one process of that group owned
(shards.py), as `data.bin` (the pieces' bytes, back to back) and `manifest.json` (each piece's leaf, box, offset
and size; the state's leaf paths, shapes and dtypes; the run's metadata at that step). A host holds the sets its
own process wrote and the sets its ring predecessor pushed to it (peers.py). A set is written into a temporary
directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np

_SET = re.compile(r"^a(\d+)_s(\d+)_p(\d+)of(\d+)$")


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
    """Host memory where there is a tmpfs for it, else the temporary directory."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))) / "reve_jax"


def run_id(workdir) -> str:
    """Names a run's snapshots by its (absolute) run directory: two runs on one host never mix."""
    return hashlib.sha256(str(Path(workdir).absolute()).encode()).hexdigest()[:16]


class HostStore:
    """The sets under `root` (`<snapshot_dir>/<run id>/<host>`). Thread-safe within a process."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ writing
    def _tmp(self, sid: SetId) -> Path:
        tmp = self.root / f".tmp_{sid.name}_{os.getpid()}_{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def _commit(self, tmp: Path, sid: SetId) -> None:
        final = self.root / sid.name
        with self._lock:
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)

    def write(self, sid: SetId, manifest: dict, arrays: list[np.ndarray]) -> None:
        """Stores this process's pieces (`arrays`, in the manifest's order; offsets, sizes and the data's SHA-256,
        which a peer checks when the set is pushed to it, are filled in here)."""
        tmp = self._tmp(sid)
        entries, offset = [], 0
        digest = hashlib.sha256()
        with open(tmp / "data.bin", "wb") as f:
            for entry, a in zip(manifest["pieces"], arrays, strict=True):
                buf = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                f.write(buf)
                digest.update(buf)
                entries.append([*entry[:2], offset, buf.nbytes])
                offset += buf.nbytes
        manifest = dict(manifest, pieces=entries, data_sha256=digest.hexdigest())
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        self._commit(tmp, sid)

    def receive(self, sid: SetId, manifest: bytes, stream, size: int, digest) -> Path:
        """Writes a set pushed by a peer into a temporary directory: `manifest` (JSON bytes), then `size` data
        bytes read from `stream` (a file-like with `read`), fed to `digest` (a hashlib object) on the way.
        Returns the directory: the caller checks the digest, then `commit`s or `discard`s it. Raises on a short
        read."""
        tmp = self._tmp(sid)
        (tmp / "manifest.json").write_bytes(manifest)
        left = size
        with open(tmp / "data.bin", "wb") as f:
            while left:
                chunk = stream.read(min(left, 1 << 20))
                if not chunk:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise ConnectionError(f"peer closed after {size - left} of {size} bytes")
                digest.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        return tmp

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
        return (self.root / sid.name / "manifest.json").read_bytes()

    def manifest(self, sid: SetId) -> dict:
        return json.loads(self.manifest_bytes(sid))

    def read(self, sid: SetId, entries: list[list]) -> list[bytes]:
        """The bytes of manifest piece entries [leaf, box, offset, nbytes]."""
        out = []
        with open(self.root / sid.name / "data.bin", "rb") as f:
            for _, _, offset, nbytes in entries:
                f.seek(offset)
                data = f.read(nbytes)
                if len(data) != nbytes:
                    raise OSError(f"{sid.name}: piece at {offset} is short ({len(data)} of {nbytes} bytes)")
                out.append(data)
        return out

    # ------------------------------------------------------------ keeping it small
    def prune(self, attempt: int, keep: int = 2) -> None:
        """Keeps the newest `keep` steps of each (attempt, owner), and drops sets of other attempts that the
        current `attempt` has overtaken (a step at or below the newest one this attempt holds here)."""
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
            for tmp in self.root.glob(".tmp_*"):  # left by a process killed while writing
                if time.time() - tmp.stat().st_mtime > 600:
                    shutil.rmtree(tmp, ignore_errors=True)

    def clear(self) -> None:
        with self._lock:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)

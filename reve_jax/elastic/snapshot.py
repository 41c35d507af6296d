"""Frequent in-memory snapshots of the train state, each host's pieces also held by its ring successor, and the
restore that prefers them to the disk checkpoint.

    snaps = Snapshots.create(cfg, workdir, worker, run.setup.abstract_state)   # None with elastic.snapshot_every=0
    got = snaps.restore(abstract_state, newer_than=<latest disk step>)         # (state, meta) or None: use the disk
    hooks += [snaps.hook(checkpoint_hook.meta)]                                # every elastic.snapshot_every steps

Saving (`SnapshotHook`, a loop hook). At a snapshot step the main thread only dispatches a device-side copy of
the state (the next step donates the original) and hands it to a thread; the thread copies this process's pieces
(shards.py: every distinct shard saved by exactly one process) to host memory, writes them as one set into the
host's store (snapstore.py, /dev/shm by default: it outlives the process, which the supervisor SIGKILLs on any
failure) and pushes the set to the next process of the group (peers.py). A snapshot that comes while the
previous one is still on its way is skipped rather than waited for: training never stalls on a snapshot.

Restoring (`Snapshots.restore`, called by the trainer before the disk checkpoint). Every process publishes which
sets its host holds (the coordination service's key-value store); all pick the same newest step at which every
process of the group that wrote it has a set somewhere in the new group (its own host, or its successor's copy),
provided it is not older than the newest disk checkpoint. Each process reads the pieces its devices need under
the new mesh, from its own store or from the host holding them, and builds its arrays. All processes then vote;
if any failed (a host unreachable, a short read), all read the disk checkpoint instead. So the disk is read only
when some piece has no surviving copy: two neighbouring hosts lost at once, or a failure before the first
snapshot was pushed.

A run's snapshots live under `<elastic.snapshot_dir>/<run id>/<host>` (default root `/dev/shm/reve_jax-<uid>`,
private to its user: snapstore.private_root). The run id and the key that signs every manifest come from a
random token in `<workdir>/.snapshot_run` (mode 0600; new on `--fresh`), so a workdir removed and made again
never picks up the old run's state, and a set changed in place fails its check on every read and fetch. The
token never travels over the network: process 0 writes it, the others read it from the shared run directory. A
process of a group the supervisor gave up on writes no set (its fence guards the run's snapshot directory as it
guards the run directory: fence.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from reve_jax.elastic import auth, peers, shards
from reve_jax.elastic.snapstore import HostStore, SetId, check_piece, default_root, private_root

log = logging.getLogger("reve_jax")

KV_TIMEOUT_MS = 120_000
RUN_FILE = ".snapshot_run"


@jax.jit
def _device_copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _kv():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("snapshots across processes need jax.distributed (the elastic launcher)")
    return global_state.client


def leaf_specs(leaves_with_paths) -> list[list]:
    """[path, shape, dtype] per leaf: what a saved set must match to be restored into this state."""
    return [[jax.tree_util.keystr(p), list(x.shape), str(np.dtype(x.dtype))] for p, x in leaves_with_paths]


def choose(inventory: dict[int, list[str]], newer_than: int) -> tuple[tuple[int, int, int], dict] | None:
    """The snapshot to restore from what each process's host holds (`inventory`: process -> set names):
    ((step, attempt, n), {owner: [processes holding its set]}) for the newest step, at or after `newer_than`,
    whose writers (processes 0..n-1 of group `attempt`) all have a set in the inventory; None when there is
    none. The same answer on every process: it depends on the inventory alone."""
    holders: dict[tuple[int, int, int], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for pid, names in inventory.items():
        for name in names:
            sid = SetId.parse(name)
            if sid is not None:
                holders[(sid.step, sid.attempt, sid.n)][sid.owner].append(pid)
    complete = [k for k, owners in holders.items() if k[0] >= newer_than and set(owners) == set(range(k[2]))]
    if not complete:
        return None
    best = max(complete)
    return best, {o: sorted(p) for o, p in holders[best].items()}


class Snapshots:
    """One process's side of the snapshots of a run (module docstring)."""

    def __init__(self, cfg, workdir, worker, abstract_state, fresh: bool = False):
        self.every = int(cfg.elastic.snapshot_every)
        self.workdir = Path(workdir)
        self.pid, self.n = jax.process_index(), jax.process_count()
        self.attempt = int(getattr(worker, "attempt", 0))
        self.secret = getattr(worker, "secret", None)
        flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
        self.specs = leaf_specs(flat)
        self.abstract_state = abstract_state
        self.pieces = shards.plan([x for _, x in flat])
        self.owned = [p for p in self.pieces if p.owner == self.pid]
        host = getattr(worker, "host", "") or os.uname().nodename
        root = private_root(cfg.elastic.snapshot_dir or default_root())
        token = self._run_token(fresh)
        run_dir = root / hashlib.sha256(token).hexdigest()[:16]
        guard = getattr(worker, "guard_writes", None)
        if guard is not None:  # a superseded process must not write sets either (fence.py)
            guard(str(run_dir))
        self.run_dir = run_dir
        self.store = HostStore(run_dir / host, auth.derive(token, "snapshot/manifest"))
        self.server = None
        self.peers: dict[int, str] = {}
        self._rounds = 0
        self.stats = {"taken": 0, "skipped": 0, "failed": 0}
        self.stats.update({k: [] for k in ("main_s", "host_s", "write_s", "push_s", "cpu_s")})
        if self.n > 1:
            if self.secret is None:
                raise RuntimeError("snapshots across processes need the run's secret: launch with scripts/launch.py")
            bind = peers.facing_address(getattr(worker, "coordinator", ""))
            self.server = peers.PeerServer(self.store, self.secret, self.attempt, bind, self._push_size)

    @classmethod
    def create(cls, cfg, workdir, worker, abstract_state, fresh: bool = False) -> Snapshots | None:
        """The run's Snapshots, or None when elastic.snapshot_every is 0. `fresh` (a run started over) gives the
        run a new token: no snapshot of its earlier life is ever restored. Every process must call it."""
        if cfg.elastic.snapshot_every <= 0:
            return None
        return cls(cfg, workdir, worker, abstract_state, fresh)

    # ------------------------------------------------------------ group plumbing
    def _run_token(self, fresh: bool) -> bytes:
        """The run's random token (RUN_FILE, mode 0600), created by process 0 (again when `fresh`); the others read
        it from the run directory once process 0 says it is there (the coordination service carries only its
        hash: the token keys the manifests' MACs, and that service is not authenticated)."""
        path = self.workdir / RUN_FILE
        if self.pid == 0:
            token = "" if fresh or not path.is_file() else path.read_text().strip()
            if not token:
                token = os.urandom(32).hex()
                self.workdir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{RUN_FILE}.tmp{os.getpid()}")
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                    f.write(token + "\n")
                os.replace(tmp, path)
            if self.n > 1:
                _kv().key_value_set("reve_snapshot/run", _digest(token))
            return token.encode()
        want = _kv().blocking_key_value_get("reve_snapshot/run", KV_TIMEOUT_MS)
        deadline = time.monotonic() + 30
        while True:  # a shared file system may show the new file a moment late
            token = path.read_text().strip() if path.is_file() else ""
            if _digest(token) == want:
                return token.encode()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} does not hold the token process 0 wrote: is the run directory shared?")
            time.sleep(0.1)

    def _all(self, what: str, value) -> dict[int, object]:
        """Every process's `value` (a JSON-able), through the coordination service; a collective."""
        if self.n == 1:
            return {0: value}
        self._rounds += 1
        client, key = _kv(), f"reve_snapshot/{what}{self._rounds}"
        client.key_value_set(f"{key}/{self.pid}", json.dumps(value))
        return {p: json.loads(client.blocking_key_value_get(f"{key}/{p}", KV_TIMEOUT_MS)) for p in range(self.n)}

    def _push_size(self, owner: int, n: int) -> int | None:
        if n != self.n:
            return None
        return sum(_nbytes(p.box, self.specs[p.leaf][2]) for p in self.pieces if p.owner == owner)

    # ------------------------------------------------------------ restore
    def restore(self, abstract_state, newer_than: int, fresh: bool = False) -> tuple[dict, dict] | None:
        """(state, meta) from the newest complete snapshot at step >= `newer_than`, laid out on the shardings of
        `abstract_state`; None when there is none or any process could not load it (then every process returns
        None). `fresh`: restore nothing (the run starts over). Every process must call it."""
        held = [] if fresh else [s.name for s in self.store.sets()]
        inventory = self._all("inventory", {"address": self.server.address if self.server else "", "sets": held})
        self.peers = {p: v["address"] for p, v in inventory.items()}
        choice = choose({p: v["sets"] for p, v in inventory.items()}, newer_than)
        if choice is None:
            if any(v["sets"] for v in inventory.values()):
                log.info("no complete in-memory snapshot at or after step %d: reading the disk checkpoint", newer_than)
            return None
        t0 = time.perf_counter()
        try:
            state, meta, fetched = self._load(choice, abstract_state)
            ok = True
        except Exception as e:  # any process's failure sends all to the disk: they must agree on one state
            log.warning("restoring the in-memory snapshot of step %d failed: %s: %s", choice[0][0], type(e).__name__, e)
            state, meta, fetched, ok = None, None, 0, False
        if not all(self._all("loaded", ok).values()):
            log.warning("a process could not load the in-memory snapshot of step %d: reading the disk", choice[0][0])
            return None
        log.info(
            "restored step %d from in-memory snapshots of group %d (%d processes) in %.2fs, %.1f MiB from peers",
            choice[0][0], choice[0][1], choice[0][2], time.perf_counter() - t0, fetched / 2**20,
        )  # fmt: skip
        return state, meta

    def _load(self, choice, abstract_state) -> tuple[dict, dict, int]:
        (step, attempt, n), holders = choice
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        leaves = [x for _, x in flat]
        parts: dict[int, list] = defaultdict(list)
        meta, fetched = None, 0
        for owner in range(n):
            sid = SetId(step, attempt, owner, n)
            pids = holders[owner]
            src = self.pid if self.pid in pids else pids[(self.pid + owner) % len(pids)]
            remote = src != self.pid
            raw = self._request(src, {"op": "manifest", "set": sid.name}) if remote else self.store.manifest_bytes(sid)
            manifest = self.store.parse_manifest(raw)  # its MAC under the run's key
            if manifest["leaves"] != self.specs:
                raise ValueError(f"snapshot {sid.name} holds another state structure than this config's")
            meta = meta if meta is not None else manifest["meta"]
            entries = manifest["pieces"]
            boxes = [(e[0], tuple(tuple(b) for b in e[1])) for e in entries]
            want = sorted(shards.needed(boxes, leaves))
            if remote:
                size = sum(entries[k][3] for k in want)
                blob = self._request(src, {"op": "fetch", "set": sid.name, "pieces": want}, size) if want else b""
                fetched += len(blob)
                datas, at = [], 0
                for k in want:
                    datas.append(blob[at : at + entries[k][3]])
                    check_piece(sid, entries[k], datas[-1])  # the holder checked it too; trust no one
                    at += entries[k][3]
            else:
                datas = self.store.read(sid, [entries[k] for k in want])
            for k, data in zip(want, datas, strict=True):
                leaf, box = boxes[k]
                arr = np.frombuffer(data, dtype=np.dtype(leaves[leaf].dtype)).reshape(shards.box_shape(box))
                parts[leaf].append((box, arr))
        arrays = [shards.assemble(x, parts[i]) for i, x in enumerate(leaves)]
        return jax.tree.unflatten(treedef, arrays), meta, fetched

    def _request(self, pid: int, msg: dict, max_reply: int = peers.MAX_MANIFEST) -> bytes:
        return peers.call(self.peers[pid], self.secret, dict(msg, attempt=self.attempt), max_reply=max_reply)

    # ------------------------------------------------------------ save
    def hook(self, meta_fn) -> SnapshotHook:
        """The loop hook that snapshots every elastic.snapshot_every steps; `meta_fn(ctx)` gives the run's
        metadata at a step (the checkpoint hook's)."""
        return SnapshotHook(self, meta_fn)

    def save(self, step: int, copy, meta: dict) -> None:
        """Runs on the snapshot thread: pieces to host memory, into the store, and to the successor."""
        try:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            arrays = shards.extract(jax.tree.leaves(copy), self.owned)
            del copy
            t1 = time.perf_counter()
            sid = SetId(step, self.attempt, self.pid, self.n)
            manifest = {"meta": meta, "leaves": self.specs, "pieces": [[p.leaf, p.box] for p in self.owned]}
            self.store.write(sid, manifest, arrays)
            t2 = time.perf_counter()
            if self.n > 1:
                peers.push(self.peers[(self.pid + 1) % self.n], self.secret, self.store, sid)
            t3 = time.perf_counter()
        except Exception as e:  # a snapshot is a convenience: the run goes on, the disk checkpoint stays
            self.stats["failed"] += 1
            if self.stats["failed"] <= 3:
                log.warning("snapshot of step %d failed: %s: %s", step, type(e).__name__, e)
            return
        finally:  # also after a failure: old sets and dead writers' leftovers must not fill host memory
            try:
                self.store.prune(self.attempt)
            except OSError as e:
                log.warning("pruning the snapshot store failed: %s", e)
        self.stats["taken"] += 1
        cpu = time.thread_time() - cpu0  # this thread's CPU: on a CPU "device" it is taken from the step
        for k, v in (("host_s", t1 - t0), ("write_s", t2 - t1), ("push_s", t3 - t2), ("cpu_s", cpu)):
            self.stats[k].append(v)

    def summary(self) -> dict:
        """Counts and median seconds of the snapshots taken (for logs and the trainer's summary)."""
        out = {k: self.stats[k] for k in ("taken", "skipped", "failed")}
        for k in ("main_s", "host_s", "write_s", "push_s", "cpu_s"):
            out[k] = float(np.median(self.stats[k])) if self.stats[k] else 0.0
        received = self.server.receive_cpu_s if self.server is not None else []
        out["receive_cpu_s"] = float(np.median(received)) if received else 0.0
        return out

    def close(self, finished: bool = False) -> None:
        """Stops serving; a finished run's snapshots are removed (the final checkpoint is on disk): the run's
        whole directory in this host's memory, with any sets kept there for hosts that left the group."""
        if self.server is not None:
            self.server.close()
        if finished:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _nbytes(box, dtype: str) -> int:
    return int(np.prod(shards.box_shape(box), dtype=np.int64)) * np.dtype(dtype).itemsize


class SnapshotHook:
    """Every `elastic.snapshot_every` steps: a device-side copy of the state, handed to a thread (Snapshots.save).
    Not at the last step or a stop (the checkpoint hook writes those to disk)."""

    timed = True  # the main thread's share is a dispatch: it stays on the train clock, as its cost

    def __init__(self, snaps: Snapshots, meta_fn):
        self.snaps, self.meta_fn = snaps, meta_fn
        self._thread: threading.Thread | None = None
        self._copy = _device_copy.lower(snaps.abstract_state).compile()  # now, not at the first snapshot

    def due(self, ctx) -> bool:
        return ctx.step % self.snaps.every == 0 and not ctx.last and ctx.stop is None

    def __call__(self, ctx):
        if self._thread is not None and self._thread.is_alive():
            self.snaps.stats["skipped"] += 1
            return
        t0 = time.perf_counter()
        copy = self._copy(ctx.state)
        meta = self.meta_fn(ctx)
        self._thread = threading.Thread(
            target=self.snaps.save, args=(ctx.step, copy, meta), name="snapshot", daemon=True
        )
        self._thread.start()
        self.snaps.stats["main_s"].append(time.perf_counter() - t0)

    def close(self, ctx):
        if self._thread is not None:
            self._thread.join(timeout=120)
        s = self.snaps.summary()
        if s["taken"] or s["skipped"]:
            log.info(
                "snapshots: %d taken, %d skipped, %d failed; median main thread %.1f ms, to host %.1f ms, "
                "write %.1f ms, push %.1f ms; thread CPU %.1f ms, receiving the predecessor's %.1f ms",
                s["taken"], s["skipped"], s["failed"], 1e3 * s["main_s"], 1e3 * s["host_s"], 1e3 * s["write_s"],
                1e3 * s["push_s"], 1e3 * s["cpu_s"], 1e3 * s["receive_cpu_s"],
            )  # fmt: skip

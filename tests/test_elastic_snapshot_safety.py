"""What a host's snapshot store and its peer server withstand (docs/elastic.md, "What is protected"): a store
that only its user can read or replace; a set altered in place, refused on a local read and on a fetch; a
write that fails, or a writer killed mid-write, leaves no temporary directory behind; a flood of connections
does not keep a push out; a process of a superseded group writes no set."""

import errno
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest
from util import xla_flags

from reve_jax.elastic import auth, fence, peers, snapstore
from reve_jax.elastic.snapshot import Snapshots
from reve_jax.elastic.snapstore import HostStore, SetId
from reve_jax.train import builder
from tests.util import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = b"m" * 32  # a manifest key (snapshot.Snapshots derives the run's from its token)


def _set(store: HostStore, sid: SetId, arrays) -> None:
    manifest = {"meta": {"step": sid.step}, "leaves": [], "pieces": [[i, [[0, a.size]]] for i, a in enumerate(arrays)]}
    store.write(sid, manifest, arrays)


def _modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def _snapshots(tmp_path, shm, **cfg_over):
    cfg = tiny_config("elastic.snapshot_every=2", f"elastic.snapshot_dir='{shm}'", "mesh.fsdp=2")
    run = builder.build(cfg)
    worker = types.SimpleNamespace(attempt=0, host="hostA")
    return cfg, run, Snapshots.create(cfg, tmp_path / "wd", worker, run.setup.abstract_state)


def _take(snaps, run, step: int):
    state = run.init_state()
    hook = snaps.hook(lambda ctx: {"data_position": ctx.step * 8})
    ctx = types.SimpleNamespace(step=step, state=state, last=False, stop=None)
    hook(ctx)
    hook.close(ctx)
    assert snaps.summary()["taken"] == 1, snaps.summary()
    return state


# ------------------------------------------------------------------------------------------- finding 2
def test_store_is_private_and_a_root_someone_else_could_touch_is_refused(tmp_path, monkeypatch):
    """The snapshot root is made 0700 with files 0600 (the weights in clear, readable by its user only). A root
    that exists with group/other bits, is a symlink, or belongs to another user is refused with a line that says
    what to do: that user could read the weights or swap a set."""
    shm = tmp_path / "shm"
    cfg, run, snaps = _snapshots(tmp_path, shm)
    _take(snaps, run, 2)
    modes = _modes(shm)
    assert stat.S_IMODE(os.lstat(shm).st_mode) == 0o700
    assert modes and all(m == (0o700 if os.path.isdir(shm / p) else 0o600) for p, m in modes.items()), modes
    snaps.close(finished=True)

    open_root = tmp_path / "open"
    open_root.mkdir(mode=0o777)
    open_root.chmod(0o777)
    with pytest.raises(snapstore.StoreNotPrivate, match=r"group/other.*chmod 700"):
        snapstore.private_root(open_root)
    link = tmp_path / "link"
    link.symlink_to(shm)
    with pytest.raises(snapstore.StoreNotPrivate, match="symlink"):
        snapstore.private_root(link)
    uid = os.geteuid()
    monkeypatch.setattr(snapstore.os, "geteuid", lambda: uid + 1)  # shm now looks like another user's
    with pytest.raises(snapstore.StoreNotPrivate, match=f"owned by uid {uid}"):
        snapstore.private_root(shm)
    monkeypatch.undo()
    # The default is one directory per user (another user's root cannot be taken for ours).
    assert snapstore.default_root().name == f"reve_jax-{os.geteuid()}"


def test_a_set_altered_in_place_is_never_restored(tmp_path):
    """Bytes of a set changed in place (same length): the restore finds the digest wrong and falls back to the
    disk (None), instead of training from altered weights."""
    shm = tmp_path / "shm"
    cfg, run, snaps = _snapshots(tmp_path, shm)
    _take(snaps, run, 4)
    snaps.close()
    (data,) = shm.glob("*/hostA/a*/data.bin")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    again = Snapshots.create(
        cfg, tmp_path / "wd", types.SimpleNamespace(attempt=1, host="hostA"), run.setup.abstract_state
    )
    assert again.restore(run.setup.abstract_state, newer_than=0) is None
    again.close(finished=True)


def test_a_fetch_of_an_altered_set_is_refused(tmp_path):
    secret = auth.new_secret()
    b = HostStore(tmp_path / "b", KEY)
    sid = SetId(step=5, attempt=2, owner=0, n=2)
    _set(b, sid, [np.arange(6, dtype=np.float32), np.array([7], dtype=np.int32)])
    server = peers.PeerServer(b, secret, 2, "127.0.0.1", lambda owner, n: None)
    try:
        data = b.root / sid.name / "data.bin"
        raw = data.read_bytes()
        data.write_bytes(bytes([raw[0] ^ 0xFF]) + raw[1:])  # a byte of the first float, same length
        with pytest.raises(peers.PeerError, match="digest"):
            peers.call(server.address, secret, {"op": "fetch", "attempt": 2, "set": sid.name, "pieces": [0]})
        # A manifest changed in place is refused too (its MAC under the run's key).
        man = b.root / sid.name / "manifest.json"
        man.write_bytes(man.read_bytes().replace(b'"step":5', b'"step":6'))
        with pytest.raises(peers.PeerError):
            peers.call(server.address, secret, {"op": "manifest", "attempt": 2, "set": sid.name})
        with pytest.raises(snapstore.SetDamaged):
            b.manifest(sid)
    finally:
        server.close()


# ------------------------------------------------------------------------------------------- finding 3
def test_a_flood_of_connections_does_not_keep_a_push_out(tmp_path):
    """64 idle and 64 dripping connections to a host's peer server, reopened whenever closed: the predecessor's
    push still lands within 2 s."""
    secret = auth.new_secret()
    a, b = HostStore(tmp_path / "a", KEY), HostStore(tmp_path / "b", KEY)
    arrays = [np.arange(6, dtype=np.float32)]
    sid = SetId(step=5, attempt=2, owner=0, n=2)
    _set(a, sid, arrays)
    server = peers.PeerServer(b, secret, 2, "127.0.0.1", lambda owner, n: 24)
    stopping = threading.Event()

    def hold(drip: bool):
        host, port = server.address.rsplit(":", 1)
        while not stopping.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    s.settimeout(0.5)
                    while not stopping.is_set():
                        if drip:
                            s.sendall(b"x")
                        try:
                            if s.recv(1) == b"":
                                break
                        except TimeoutError:
                            continue
            except OSError:
                time.sleep(0.01)

    threads = [threading.Thread(target=hold, args=(i % 2 == 0,), daemon=True) for i in range(128)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        while True:
            try:
                peers.push(server.address, secret, a, sid, timeout=2.0)
                break
            except peers.PeerError:
                assert time.monotonic() - t0 < 2.0, "the push never got through the flood"
        print(f"push through the flood after {time.monotonic() - t0:.2f} s; dropped {dict(server.rejected)}")
        assert b.sets() == [sid] and time.monotonic() - t0 < 2.0
    finally:
        stopping.set()
        for t in threads:
            t.join(timeout=5)
        server.close()


# ------------------------------------------------------------------------------------------- finding 4
class _FailingArray:
    """An array whose bytes cannot be had: the write fails half-way, as on a full /dev/shm."""

    def __array__(self, dtype=None, copy=None):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_leaves_no_temporary_directory(tmp_path):
    store = HostStore(tmp_path / "s", KEY)
    sid = SetId(step=3, attempt=0, owner=0, n=1)
    manifest = {"meta": {}, "leaves": [], "pieces": [[0, [[0, 6]]], [1, [[0, 6]]]]}
    with pytest.raises(OSError, match="No space"):
        store.write(sid, manifest, [np.arange(6, dtype=np.float32), _FailingArray()])
    assert os.listdir(store.root) == [] and store.sets() == []


STALLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from reve_jax.elastic.snapstore import HostStore, SetId
    class Stall:
        def __array__(self, dtype=None, copy=None):
            print("writing", flush=True)
            time.sleep(600)
    store = HostStore(sys.argv[1], b"m" * 32)
    manifest = {"meta": {}, "leaves": [], "pieces": [[0, [[0, 4096]]], [1, [[0, 6]]]]}
    store.write(SetId(1, 0, 0, 1), manifest, [np.zeros(4096, np.float32), Stall()])
    """
)


def test_a_writer_killed_mid_write_leaves_nothing_once_the_store_is_opened_again(tmp_path):
    """A process SIGKILLed while it writes a set (the supervisor kills whole groups) leaves a temporary directory;
    the next process to open the store removes it at once, not ten minutes later."""
    root = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WRITER, str(root)], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        assert [p for p in os.listdir(root) if p.startswith(".tmp")]  # what a killed writer leaves
    finally:
        proc.kill()
        proc.wait(timeout=10)
    HostStore(root, KEY)  # the next group's process on this host
    assert os.listdir(root) == []


def test_a_full_store_fails_the_snapshot_and_frees_what_it_wrote(tmp_path):
    """On a real full tmpfs (root only, as in CI): the set does not fit, the write fails with ENOSPC, and the
    space is free again afterwards (a full /dev/shm would starve NCCL and other users)."""
    disk = tmp_path / "shm"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True, timeout=30)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}): needs root")
    try:
        store = HostStore(disk / "s", KEY)
        sid = SetId(step=3, attempt=0, owner=0, n=1)
        manifest = {"meta": {}, "leaves": [], "pieces": [[0, [[0, 1 << 19]]]]}
        with pytest.raises(OSError) as e:
            store.write(sid, manifest, [np.zeros(1 << 19, np.float32)])  # 2 MiB into 1 MiB
        assert e.value.errno == errno.ENOSPC
        assert os.listdir(store.root) == []
        st = os.statvfs(disk)
        assert (st.f_blocks - st.f_bfree) * st.f_frsize < 64 << 10  # directories only
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)


# ------------------------------------------------------------------------------------------- finding 7
FENCED_SNAPSHOT = textwrap.dedent(
    """
    import os, sys, time, types
    import jax, numpy as np
    from reve_jax.elastic.fence import Fence
    from reve_jax.elastic.snapshot import Snapshots
    from reve_jax.elastic.worker import WorkerContext
    wd, shm = sys.argv[1], sys.argv[2]
    ctx = WorkerContext(attempt=3, host="h")
    ctx._fence = Fence(wd, 3).install()
    cfg = types.SimpleNamespace(elastic=types.SimpleNamespace(snapshot_every=1, snapshot_dir=shm))
    a = jax.device_put(np.arange(8, dtype=np.float32))
    abstract = {"w": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)}
    snaps = Snapshots.create(cfg, wd, ctx, abstract)
    snaps.save(1, {"w": a}, {"step": 1})
    print("saved 1", flush=True)
    while not os.path.exists(os.path.join(wd, "go")):
        time.sleep(0.01)
    snaps.save(2, {"w": a}, {"step": 2})
    print("saved 2", flush=True)
    """
)


def test_a_superseded_group_writes_no_snapshot(tmp_path):
    """Snapshots live outside the run directory (host memory), so the run directory's fence alone did not stop
    a superseded process from writing a set there: now the store is fenced too."""
    wd, shm = tmp_path / "run", tmp_path / "shm"
    wd.mkdir()
    fence.write_fence(str(wd), 3)
    proc = subprocess.Popen(
        [sys.executable, "-c", FENCED_SNAPSHOT, str(wd), str(shm)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags()),
    )
    try:
        assert proc.stdout.readline().strip() == "saved 1", proc.stderr.read() if proc.poll() is not None else ""
        fence.write_fence(str(wd), 4)  # the supervisor gave up on group 3
        (wd / "go").write_text("")
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == fence.EXIT_FENCED and "saved 2" not in out, (out, err)
    names = sorted(p.name for p in shm.glob("*/h/a*"))
    assert names and all("_s000000000001_" in n for n in names), names
    assert not list(shm.glob("*/h/.tmp*"))

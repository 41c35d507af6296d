"""In-memory snapshots (reve_jax/elastic/snapshot.py, shards.py, snapstore.py, peers.py) in one process: the
layout saves every shard once and spreads a replicated state over the processes; pieces saved under a 4-process
mesh rebuild the state exactly on another mesh; sets travel between two host stores only with the run's key and
group; the restore picks the newest complete step; a snapshot taken by the hook restores after a "restart".

Processes are emulated on the 8 CPU devices (device id // 2 = process). The multi-process path (key-value
exchange, pushes to the ring successor, fetches from peers) runs in tests/test_elastic_e2e.py.
"""

import types
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from reve_jax.elastic import auth, peers, shards
from reve_jax.elastic.snapshot import Snapshots, choose
from reve_jax.elastic.snapstore import HostStore, SetId
from reve_jax.train import builder
from tests.util import tiny_config


def emulated(device) -> int:
    return device.id // 2


def _mesh(devices, shape):
    return jax.sharding.Mesh(
        np.asarray(devices).reshape(shape), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _state(mesh):
    """A train-state-like tree: replicated, sharded on one axis, on both, uneven over processes, a scalar, bf16."""
    specs = {
        "params": {"w": P(None, "fsdp"), "b": P()},
        "opt": {"mu": P("data", "fsdp"), "nu": P("fsdp")},
        "ema": {"w": P(None, "fsdp")},
        "step": P(),
        "rng": P(),
    }
    shapes = {"params": {"w": (6, 8), "b": (8,)}, "opt": {"mu": (4, 8), "nu": (12,)}, "ema": {"w": (6, 8)}}
    shapes.update(step=(), rng=(2,))
    dtypes = {"rng": np.uint32, "step": np.int32}
    out = {}
    for k, sub in specs.items():
        leaves = sub if isinstance(sub, dict) else {None: sub}
        shp = shapes[k] if isinstance(sub, dict) else {None: shapes[k]}
        built = {}
        for name, spec in leaves.items():
            dtype = dtypes.get(k, jnp.bfloat16 if name == "nu" else np.float32)
            x = np.arange(int(np.prod(shp[name])), dtype=np.float32).reshape(shp[name]) + 1
            built[name] = jax.device_put(x.astype(dtype), NamedSharding(mesh, spec))
        out[k] = built if isinstance(sub, dict) else built[None]
    return out


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pieces_saved_once_spread_over_processes_and_rebuilt_on_another_mesh():
    state = _state(_mesh(jax.devices(), (4, 2)))  # 8 devices = 4 emulated processes of 2
    leaves = jax.tree.leaves(state)
    pieces = shards.plan(leaves, emulated)
    # Every distinct shard of every leaf once, by a process that holds it.
    for i, leaf in enumerate(leaves):
        boxes = {shards.box_of(ix, leaf.shape) for ix in leaf.sharding.devices_indices_map(leaf.shape).values()}
        assert sorted(p.box for p in pieces if p.leaf == i) == sorted(boxes)
    owners = Counter(p.owner for p in pieces)
    assert set(owners) == {0, 1, 2, 3} and max(owners.values()) <= 2 * min(owners.values())
    saved = []  # (leaf, box, data) of all 4 emulated processes
    for pid in range(4):
        mine = [p for p in pieces if p.owner == pid]
        saved += [(p.leaf, p.box, a) for p, a in zip(mine, shards.extract(leaves, mine, emulated), strict=True)]
    # Onto 6 devices as 2 x 3: another layout (uneven boxes against the old ones), another process count.
    target = jax.tree.map(lambda x: x.sharding.spec, state)
    mesh6 = _mesh(jax.devices()[:6], (2, 3))
    abstract = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh6, _fit(spec, x.shape))),
        state,
        target,
    )
    flat6, treedef = jax.tree.flatten(abstract)
    need = shards.needed([(leaf, box) for leaf, box, _ in saved], flat6, process=0, process_of=emulated)
    assert 0 < len(need) < len(saved)  # process 0 of the new mesh needs only what overlaps its devices
    rebuilt = [shards.assemble(x, [(box, data) for leaf, box, data in saved if leaf == i]) for i, x in enumerate(flat6)]
    _equal(state, jax.tree.unflatten(treedef, rebuilt))
    assert all(r.sharding == a.sharding for r, a in zip(rebuilt, flat6, strict=True))
    with pytest.raises(ValueError, match="cover"):
        shards.fill(((0, 4),), np.float32, [(((0, 2),), np.zeros(2, np.float32))])


def _fit(spec, shape):
    """`spec` on the 2 x 3 mesh, each dimension kept sharded only where the axis divides it."""
    sizes = {"data": 2, "fsdp": 3}
    dims = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*(a if a is not None and n % sizes[a] == 0 else None for a, n in zip(dims, shape, strict=True)))


def test_choose_takes_the_newest_complete_step():
    names = lambda step, owners, attempt=3, n=4: [SetId(step, attempt, o, n).name for o in owners]  # noqa: E731
    inventory = {0: names(10, [0, 3]) + names(12, [0]), 1: names(10, [1, 0]) + names(12, [1, 0]), 2: names(10, [2])}
    (key, holders) = choose(inventory, newer_than=0)
    assert key == (10, 3, 4) and holders == {0: [0, 1], 1: [1], 2: [2], 3: [0]}  # step 12 lacks owners 2, 3
    assert choose(inventory, newer_than=11) is None  # the disk checkpoint is newer
    assert choose({0: names(12, [0, 1], attempt=4, n=2), 1: names(12, [0], attempt=3)}, 0)[0] == (12, 4, 2)


def _set(store: HostStore, sid: SetId, arrays):
    manifest = {"meta": {"step": sid.step}, "leaves": [], "pieces": [[i, [[0, a.size]]] for i, a in enumerate(arrays)]}
    store.write(sid, manifest, arrays)


def test_sets_travel_between_hosts_only_with_the_runs_key_and_group(tmp_path):
    secret = auth.new_secret()
    a, b = HostStore(tmp_path / "a", b"m" * 32), HostStore(tmp_path / "b", b"m" * 32)
    arrays = [np.arange(6, dtype=np.float32), np.array([7], dtype=np.int32)]
    sid = SetId(step=5, attempt=2, owner=0, n=2)
    _set(a, sid, arrays)
    size = sum(x.nbytes for x in arrays)
    server = peers.PeerServer(b, secret, 2, "127.0.0.1", lambda owner, n: size if n == 2 else None)
    try:
        peers.push(server.address, secret, a, sid)
        assert b.sets() == [sid]
        manifest = b.parse_manifest(
            peers.call(server.address, secret, {"op": "manifest", "attempt": 2, "set": sid.name})
        )
        data = peers.call(server.address, secret, {"op": "fetch", "attempt": 2, "set": sid.name, "pieces": [1]})
        assert np.frombuffer(data, np.int32).tolist() == [7] and len(manifest["pieces"]) == 2
        # A stale group, a wrong key, a replayed (older) push and a short one are all refused.
        with pytest.raises(peers.PeerError, match="refused by group 2"):
            peers.call(server.address, secret, {"op": "manifest", "attempt": 1, "set": sid.name})
        with pytest.raises(peers.PeerError):
            peers.call(server.address, auth.new_secret(), {"op": "manifest", "attempt": 2, "set": sid.name})
        old = SetId(step=4, attempt=2, owner=0, n=2)
        _set(a, old, arrays)
        with pytest.raises(peers.PeerError, match="not newer"):
            peers.push(server.address, secret, a, old)
        small = SetId(step=9, attempt=2, owner=0, n=2)
        _set(a, small, arrays[:1])
        with pytest.raises(peers.PeerError, match="refused"):
            peers.push(server.address, secret, a, small)
        assert b.sets() == [sid] and server.rejected["bad_mac"] == 1
        # A tampered set fails its digest at the receiver.
        evil = SetId(step=11, attempt=2, owner=0, n=2)
        _set(a, evil, arrays)
        (a.root / evil.name / "data.bin").write_bytes(b"\0" * size)
        with pytest.raises(peers.PeerError, match="digest"):
            peers.push(server.address, secret, a, evil)
        assert b.sets() == [sid]
    finally:
        server.close()


def test_snapshot_hook_then_restore_after_a_restart(tmp_path):
    cfg = tiny_config("elastic.snapshot_every=2", f"elastic.snapshot_dir='{tmp_path / 'shm'}'", "mesh.fsdp=2")
    run = builder.build(cfg)
    state = run.init_state()
    worker = types.SimpleNamespace(attempt=0, host="hostA")
    snaps = Snapshots.create(cfg, tmp_path / "wd", worker, run.setup.abstract_state)
    hook = snaps.hook(lambda ctx: {"data_position": ctx.step * 8, "train_wall_s": 1.5})
    ctx = types.SimpleNamespace(step=4, state=state, last=False, stop=None)
    assert hook.due(ctx) and not hook.due(types.SimpleNamespace(step=3, last=False, stop=None))
    hook(ctx)
    hook.close(ctx)
    assert snaps.summary()["taken"] == 1 and snaps.summary()["main_s"] > 0
    snaps.close()
    # A new process of the same run directory (same token) finds it; a newer disk checkpoint wins.
    again = Snapshots.create(cfg, tmp_path / "wd", worker, run.setup.abstract_state)
    restored, meta = again.restore(run.setup.abstract_state, newer_than=3)
    assert meta == {"data_position": 32, "train_wall_s": 1.5}
    _equal(state, restored)
    assert again.restore(run.setup.abstract_state, newer_than=5) is None
    assert again.restore(run.setup.abstract_state, newer_than=0, fresh=True) is None
    # Another workdir at the same path after `fresh` gets a new token: the old snapshot is never seen again.
    fresh = Snapshots.create(cfg, tmp_path / "wd", worker, run.setup.abstract_state, fresh=True)
    assert fresh.restore(run.setup.abstract_state, newer_than=0) is None
    again.close(finished=True)
    assert again.store.sets() == []

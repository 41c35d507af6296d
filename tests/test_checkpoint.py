"""Checkpoints: every leaf survives a round trip, a save on 8 devices restores on 4, a corrupt latest checkpoint
falls back to the previous one, and a crash in the middle of a save leaves the previous one usable."""

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from util import tiny_config

from reve_jax import sharding
from reve_jax.checkpoint import Checkpointer, CheckpointError
from reve_jax.train import train_state


def _setup(devices, *extra):
    cfg = tiny_config("optim.name='muon'", "ema.decays=(0.9, 0.99)", *extra)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    return train_state.make_setup(cfg, mesh)


def _assert_trees_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for (path, x), y in zip(fa, fb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def _changed(state):
    """A state whose every leaf differs from init (so a restore that returns init values would fail)."""
    leaves, treedef = jax.tree.flatten(state)
    out = [x + np.asarray(1 + i, x.dtype) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def test_round_trip_compares_every_leaf(tmp_path):
    setup = _setup(jax.devices())
    state = _changed(train_state.init_state(setup))
    ckpt = Checkpointer(tmp_path, keep=2, async_save=True)
    ckpt.save(7, state, {"data_position": 7 * 8, "note": "x"})
    ckpt.wait()
    restored, meta = ckpt.restore_latest(setup.abstract_state)
    _assert_trees_equal(state, restored)
    assert meta["step"] == 7 and meta["data_position"] == 56 and meta["note"] == "x"
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(setup.abstract_state), strict=True):
        assert got.sharding == want.sharding
    ckpt.close()


def test_a_cpu_save_copies_each_replicated_array_once(tmp_path, monkeypatch):
    """CPU devices are host memory: a replicated array is saved from one replica, not cut into a slice per replica
    (Orbax's default, one dispatched slice program each: 2,888 for this state on 8 devices). The same save under
    Orbax's default handler slices, so the count can fail."""
    from orbax.checkpoint._src.serialization import type_handler_registry

    from reve_jax import checkpoint

    setup = _setup(jax.devices())
    state = train_state.init_state(setup)
    slices, real = [], jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **kw: slices.append(a[0].shape) or real(*a, **kw))

    def save(directory):
        ckpt = Checkpointer(directory, async_save=False)
        ckpt.save(1, state, {"data_position": 8})
        ckpt.close()
        n = len(slices)
        slices.clear()
        return n

    assert save(tmp_path / "ours") == 0
    registry = type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY
    ours = registry.get(jax.Array)
    registry.add(jax.Array, checkpoint.ocp.type_handlers.ArrayHandler(), override=True, ignore_warnings=True)
    try:
        assert save(tmp_path / "orbax_default") > len(jax.tree.leaves(state))
    finally:
        registry.add(jax.Array, ours, override=True, ignore_warnings=True)


def test_staged_save_survives_the_next_step_donating_the_state(tmp_path):
    """stage() snapshots on the device and copies to pinned host memory; a step that donates (and so overwrites)
    the state's buffers before commit() must not change what is saved. Saves stay in step order."""
    setup = _setup(jax.devices(), "mesh.fsdp=2")
    state = _changed(train_state.init_state(setup))
    want = jax.device_get(state)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + jax.numpy.asarray(1, x.dtype), s), donate_argnums=0)
    ckpt = Checkpointer(tmp_path, keep=3, async_save=True)
    assert ckpt.stage(4, state, {"data_position": 32})
    assert ckpt.staged_step == 4 and ckpt.steps() == []
    state = bump(state)  # the next step: donates the staged state's buffers
    assert ckpt.commit() and ckpt.staged_step is None and not ckpt.commit()
    ckpt.stage(5, state, {"data_position": 40})
    state = bump(state)
    ckpt.save(6, state, {"data_position": 48})  # commits step 5 first
    ckpt.wait()
    assert ckpt.steps() == [4, 5, 6]
    restored, meta = ckpt.restore(4, setup.abstract_state)
    _assert_trees_equal(want, jax.device_get(restored))
    assert meta["data_position"] == 32
    for got, target in zip(jax.tree.leaves(restored), jax.tree.leaves(setup.abstract_state), strict=True):
        assert got.sharding == target.sharding  # device memory again, not pinned host
    ckpt.stage(7, state, {"data_position": 56})
    ckpt.close()  # commits the staged save
    reader = Checkpointer(tmp_path)
    assert reader.steps() == [5, 6, 7]  # keep=3
    reader.close()


def test_save_on_8_devices_restores_on_4(tmp_path):
    setup8 = _setup(jax.devices(), "mesh.fsdp=2")
    state = _changed(train_state.init_state(setup8))
    assert any(len(x.sharding.device_set) == 8 for x in jax.tree.leaves(state))
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, state, {"data_position": 24})
    ckpt.close()
    setup4 = _setup(jax.devices()[:4], "mesh.fsdp=2")
    restored, _ = Checkpointer(tmp_path).restore_latest(setup4.abstract_state)
    assert all(x.sharding.device_set <= set(jax.devices()[:4]) for x in jax.tree.leaves(restored))
    _assert_trees_equal(jax.device_get(state), jax.device_get(restored))


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    setup = _setup(jax.devices())
    s1 = _changed(train_state.init_state(setup))
    s2 = _changed(s1)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, s1, {"data_position": 8})
    ckpt.save(2, s2, {"data_position": 16})
    ckpt.close()
    damaged = 0
    for root, _, files in os.walk(tmp_path / "checkpoints" / "2" / "state"):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(path) // 3))
            damaged += 1
    assert damaged
    ckpt = Checkpointer(tmp_path)
    restored, meta = ckpt.restore_latest(setup.abstract_state)
    assert meta["step"] == 1
    _assert_trees_equal(jax.device_get(s1), jax.device_get(restored))
    # Nothing that was saved is lost: the damaged step moved aside, and step 2 can be written again.
    assert list((tmp_path / "checkpoints_corrupt").iterdir())
    assert ckpt.steps() == [1]
    ckpt.save(2, restored, {"data_position": 16})
    ckpt.close()


def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
    setup = _setup(jax.devices())
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, train_state.init_state(setup), {"data_position": 8})
    ckpt.close()
    for root, _, files in os.walk(tmp_path / "checkpoints" / "1" / "state"):
        for f in files:
            open(os.path.join(root, f), "wb").close()
    with pytest.raises(CheckpointError, match="could be restored"):
        Checkpointer(tmp_path).restore_latest(setup.abstract_state)


CRASH_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from reve_jax.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=5, async_save=True)
    small = {"w": jnp.arange(10.0)}
    ckpt.save(1, small, {"data_position": 1})
    ckpt.wait()
    keys = jax.random.split(jax.random.key(0), 96)
    big = {f"w{i}": jax.random.normal(keys[i], (1024, 1024)) for i in range(96)}  # 384 MiB that do not compress
    jax.block_until_ready(big)
    ckpt.save(2, big, {"data_position": 2})
    print("SAVING", flush=True)
    time.sleep(60)
""")
MIB = 2**20


def _bytes_under(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file renamed while we look
                total += os.path.getsize(os.path.join(root, f))
    return total


def test_crash_during_save_leaves_previous_checkpoint_usable(tmp_path):
    """SIGKILL while the second save is writing: the kill waits until the save's temporary directory holds some
    of its 384 MiB, and after the kill that directory is still the temporary one (never committed), with part of
    the data in it. The previous checkpoint is then the latest and restores; the next open to train removes the
    partial one, an open to read does not."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu"),
    )
    ckpts = tmp_path / "checkpoints"
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and proc.stdout.readline().strip() == "SAVING", "the subprocess never started its second save"
        deadline = time.time() + 120
        while time.time() < deadline:
            writing = [p for p in ckpts.iterdir() if p.name.startswith("2.") and "tmp" in p.name]
            if writing and _bytes_under(writing[0]) > 16 * MIB:
                break
            assert not (ckpts / "2").exists(), "the save finished before the kill: make it larger"
            time.sleep(0.005)
        else:
            pytest.fail("the second save never started writing")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The kill landed mid-write: the step-2 data is partly on disk, in a directory that was never committed.
    assert not (ckpts / "2").exists()
    assert 16 * MIB < _bytes_under(writing[0]) < 384 * MIB, _bytes_under(writing[0]) / MIB
    reader = Checkpointer(tmp_path, reader=True)  # sampling or scoring a run that may be saving right now
    assert reader.steps() == [1] and writing[0].exists(), "a reader leaves every temporary directory alone"
    reader.close()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.steps() == [1], "the interrupted save must not count as a complete checkpoint"
    assert not writing[0].exists(), "opening the checkpoints to train removes the failed save's temporary directory"
    abstract = {
        "w": jax.ShapeDtypeStruct((10,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    }
    restored, meta = ckpt.restore_latest(abstract)
    np.testing.assert_array_equal(restored["w"], np.arange(10.0))
    assert meta["step"] == 1

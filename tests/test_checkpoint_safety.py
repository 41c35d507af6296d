"""Checkpoint safety: a checkpoint is set aside only when its files cannot be decoded; an out-of-memory, I/O or
structure error moves nothing; a workdir with history never starts over without `fresh`; a failed save is one
line (path, cause, last good step) and loses nothing. Tiny trees on the 8 emulated CPU devices, plus a real
full disk (a 40 MB tmpfs) and, marked slow, the same checks through scripts/train.py."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from util import TINY, xla_flags

from reve_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointRestoreError,
    CheckpointSaveError,
    StructureMismatchError,
    is_corruption,
    resume,
)
from reve_jax.elastic import backends

REPO = Path(__file__).resolve().parent.parent


def _mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _state(offset: float = 0.0, rows: int = 16):
    """A small train-state-like tree: nested dicts, a list, an int scalar; every leaf depends on `offset`."""
    mesh = _mesh()
    rowwise, rep = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    w = jax.random.normal(jax.random.key(0), (rows, 256)) + offset  # 16 KiB that do not compress: a data file
    return {
        "params": {"w": jax.device_put(w, rowwise), "b": jax.device_put(jnp.full((8,), offset), rep)},
        "opt_state": [jax.device_put(w * 2, rowwise), jax.device_put(jnp.ones((3,)) * offset, rep)],
        "step": jax.device_put(jnp.asarray(int(offset), jnp.int32), rep),
    }


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _files(root: Path) -> dict[str, int]:
    """Every file under `root` by name (without its directory) and size: moving keeps this, deleting does not."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = p.stat().st_size
    return out


def _file_contents(root: Path) -> list[tuple[str, int]]:
    """Sorted (basename, size) of every file: the same before and after a move."""
    return sorted((Path(k).name, v) for k, v in _files(root).items())


def _saved(tmp_path, steps=(1, 2)) -> dict[int, dict]:
    ckpt = Checkpointer(tmp_path, async_save=False)
    states = {s: _state(float(s)) for s in steps}
    for s, st in states.items():
        ckpt.save(s, st, {"data_position": s})
    ckpt.close()
    return states


# ---------------------------------------------------------------- Classification
def _wrapped(inner: BaseException) -> Exception:
    """What Orbax raises around a tensorstore read error: a bare Exception whose cause is the real one."""
    try:
        raise Exception("Encountered error while reading array index: (slice(0, 8, 1),)") from inner
    except Exception as e:
        return e


OS_ERROR_TAIL = "Failed to write 2469888 bytes to file 5: No space left on device [os_error_code='28']"
CLASSIFY = [
    # files that cannot be decoded
    (ValueError("DATA_LOSS: Error decoding manifest: Encoded length (11) is less than minimum length (16)"), True),
    (_wrapped(ValueError("OUT_OF_RANGE: Requested byte range [0, 268713) is not valid for value of size 89652")), True),
    (_wrapped(ValueError("FAILED_PRECONDITION: Truncated Zstd-compressed stream; at byte 0")), True),
    (ValueError('FAILED_PRECONDITION: Error reading local file "/w/_sharding": Invalid JSON'), True),
    (ValueError('NOT_FOUND: Error reading "a/.zarray": [OS error 2: ENOENT No such file or directory]'), True),
    (json.JSONDecodeError("Expecting value", "", 0), True),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/w/checkpoints/2/state/_METADATA"), True),
    (KeyError("Item \"state\" was not found in the checkpoint. Available items: ['meta']"), True),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), True),
    # the environment, not the files
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB"), False),
    (_wrapped(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: device buffer")), False),
    (_wrapped(ValueError(f'RESOURCE_EXHAUSTED: Error reading "a/0": {OS_ERROR_TAIL}')), False),
    (ValueError('FAILED_PRECONDITION: Error reading "a/0": [OS error 5: EIO Input/output error]'), False),
    (ValueError("UNAVAILABLE: file system not responding"), False),
    (ValueError("DEADLINE_EXCEEDED: read timed out"), False),
    (ValueError("PERMISSION_DENIED: Error opening file"), False),
    (OSError(errno.EIO, "Input/output error"), False),
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.ESTALE, "Stale file handle"), False),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (TimeoutError("barrier timed out"), False),
    (MemoryError(), False),
    (StructureMismatchError("checkpoint 2 does not match"), False),
    (RuntimeError("something nobody has seen before"), False),
    (ValueError("User-provided restore item and on-disk value metadata tree structures do not match"), False),
]


@pytest.mark.parametrize("exc,corrupt", CLASSIFY, ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(CLASSIFY)])
def test_is_corruption_table(exc, corrupt):
    assert is_corruption(exc) is corrupt


# ---------------------------------------------------------------- Structure
def test_structure_mismatch_names_the_paths_and_moves_nothing(tmp_path):
    states = _saved(tmp_path)
    before = _files(tmp_path)
    ckpt = Checkpointer(tmp_path)
    ckpt.check_structure(2, _abstract(states[2]))  # the same tree passes
    other = _abstract(_state(rows=24))  # params/w and opt_state/0 change shape
    other["params"]["b"] = jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=other["params"]["b"].sharding)
    other["params"]["extra"] = other["params"]["b"]  # missing from the checkpoint
    del other["opt_state"][1]  # in the checkpoint, not in this state
    for call in (lambda: ckpt.restore_latest(other), lambda: resume(ckpt, other)):
        with pytest.raises(StructureMismatchError) as e:
            call()
        msg = str(e.value)
        assert "5 differences" in msg
        for part in (
            "params/w shape saved (16, 256), now (24, 256)",
            "opt_state/0 shape saved (16, 256), now (24, 256)",
            "params/b dtype saved float32, now bfloat16",
            "params/extra missing from the checkpoint",
            "opt_state/1 in the checkpoint but not in this state",
            "convert_checkpoint.py",
            "new --workdir",
        ):
            assert part in msg, (part, msg)
    assert _files(tmp_path) == before and not (tmp_path / "checkpoints_corrupt").exists()
    assert ckpt.steps() == [1, 2]
    ckpt.close()


def test_structure_mismatch_lists_at_most_eight_paths(tmp_path):
    _saved(tmp_path, steps=(1,))
    ckpt = Checkpointer(tmp_path)
    abstract = {f"k{i:02d}": jax.ShapeDtypeStruct((2,), jnp.float32) for i in range(12)}
    with pytest.raises(StructureMismatchError, match=r"17 differences: .*; and 9 more\)\. Resume with"):
        ckpt.check_structure(1, abstract)
    ckpt.close()


# ---------------------------------------------------------------- Errors that are not corruption
INJECTED = [
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB"),
    OSError(errno.EIO, "Input/output error"),
    TimeoutError("restore timed out"),
    _wrapped(ValueError(f'RESOURCE_EXHAUSTED: Error reading "a/0": {OS_ERROR_TAIL}')),
]


@pytest.mark.parametrize("error", INJECTED, ids=lambda e: type(e).__name__)
def test_an_error_that_is_not_corruption_moves_nothing_and_propagates(tmp_path, monkeypatch, error):
    _saved(tmp_path)
    before = _files(tmp_path)
    ckpt = Checkpointer(tmp_path)

    def failing_restore(step, abstract_state):
        raise error

    monkeypatch.setattr(ckpt, "restore", failing_restore)
    for call in (lambda: ckpt.restore_latest(_abstract(_state())), lambda: resume(ckpt, _abstract(_state()))):
        with pytest.raises(CheckpointRestoreError, match="not damage to its files, so nothing was moved") as e:
            call()
        assert e.value.__cause__ is error
    assert _files(tmp_path) == before and not (tmp_path / "checkpoints_corrupt").exists()
    assert ckpt.steps() == [1, 2]
    monkeypatch.undo()
    restored, meta = Checkpointer(tmp_path).restore_latest(_abstract(_state()))
    assert meta["step"] == 2


# ---------------------------------------------------------------- Corruption
def _truncate(path: Path):
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 3)


def _damage(step_dir: Path, how: str):
    state = step_dir / "state"
    if how == "truncated_arrays":
        for p in (state / "ocdbt.process_0" / "d").iterdir():
            _truncate(p)
    elif how == "missing_arrays":
        shutil.rmtree(state / "ocdbt.process_0")
    elif how == "garbage_tree_metadata":
        (state / "_METADATA").write_bytes(b"\x00{{ not json")
    elif how == "missing_tree_metadata":
        (state / "_METADATA").unlink()
    elif how == "garbage_manifest":
        (state / "manifest.ocdbt").write_bytes(b"garbage")
    elif how == "garbage_meta_json":
        (step_dir / "meta" / "metadata").write_bytes(b'{"step": ')
    elif how == "missing_state_item":
        shutil.rmtree(state)
    else:
        raise ValueError(how)


DAMAGE = [
    "truncated_arrays",
    "missing_arrays",
    "garbage_tree_metadata",
    "missing_tree_metadata",
    "garbage_manifest",
    "garbage_meta_json",
    "missing_state_item",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_undecodable_latest_is_set_aside_and_the_previous_is_used(tmp_path, how):
    states = _saved(tmp_path)
    _damage(tmp_path / "checkpoints" / "2", how)
    before = _file_contents(tmp_path)
    ckpt = Checkpointer(tmp_path)
    restored, meta = resume(ckpt, _abstract(states[1]))
    assert meta["step"] == 1
    _assert_equal(states[1], restored)
    assert [p.name.split(".")[0] for p in (tmp_path / "checkpoints_corrupt").iterdir()] == ["2"]
    assert ckpt.steps() == [1] and _file_contents(tmp_path) == before  # moved, not deleted
    ckpt.save(2, restored, {"data_position": 2})  # the step can be written again
    ckpt.close()


def _corrupt_all(tmp_path):
    for step_dir in (tmp_path / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            _damage(step_dir, "truncated_arrays")


def test_all_corrupt_refuses_on_every_launch_and_fresh_keeps_them(tmp_path):
    states = _saved(tmp_path)
    _corrupt_all(tmp_path)
    before = _file_contents(tmp_path)
    abstract = _abstract(states[1])
    for launch in range(2):  # the supervisor relaunches by itself: the second launch must refuse too
        ckpt = Checkpointer(tmp_path)
        assert ckpt.has_history()
        with pytest.raises(CheckpointError) as e:
            resume(ckpt, abstract)
        msg = str(e.value)
        assert f"no checkpoint in {tmp_path} could be restored; 2 were set aside in " in msg, msg
        assert str(tmp_path / "checkpoints_corrupt") in msg and "pass --fresh to start over at step 0" in msg
        assert str(tmp_path / "checkpoints_replaced") in msg
        assert _file_contents(tmp_path) == before, f"launch {launch} lost files"
        assert ckpt.steps() == []
        ckpt.close()
    ckpt = Checkpointer(tmp_path)
    assert resume(ckpt, abstract, fresh=True) is None
    (kept,) = (tmp_path / "checkpoints_replaced").iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoints", "checkpoints_corrupt"]
    assert len(list((kept / "checkpoints_corrupt").iterdir())) == 2
    assert _file_contents(tmp_path) == before
    assert not ckpt.has_history() and resume(ckpt, abstract) is None  # the new run starts at step 0
    ckpt.save(1, states[1], {"data_position": 1})
    ckpt.close()
    assert resume(Checkpointer(tmp_path), abstract)[1]["step"] == 1


def test_resume_returns_the_newest_and_fresh_moves_good_checkpoints_too(tmp_path):
    assert resume(Checkpointer(tmp_path / "empty"), _abstract(_state())) is None  # no history: step 0
    states = _saved(tmp_path)
    ckpt = Checkpointer(tmp_path)
    restored, meta = resume(ckpt, _abstract(states[2]))
    assert meta["step"] == 2
    _assert_equal(states[2], restored)
    before = _file_contents(tmp_path)
    assert resume(ckpt, _abstract(states[2]), fresh=True) is None
    assert ckpt.steps() == [] and _file_contents(tmp_path) == before
    (kept,) = (tmp_path / "checkpoints_replaced").iterdir()
    assert sorted(p.name for p in (kept / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    ckpt.close()


# ---------------------------------------------------------------- Failed saves (injected)
NO_SPACE = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file "/x/checkpoints/2.orbax-checkpoint-tmp'
    f'/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "/x/d/04494c": {OS_ERROR_TAIL}'
)


def test_async_save_failure_is_reported_once_at_the_next_save_and_keeps_the_last_good(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, _state(1.0), {"data_position": 1})
    ckpt.wait()
    # The background write of step 2 fails: Orbax starts it, and waiting on it raises what tensorstore raised.
    monkeypatch.setattr(ckpt.manager, "save", lambda step, args=None, force=False: True)

    def failed_wait():
        raise NO_SPACE

    monkeypatch.setattr(ckpt.manager, "wait_until_finished", failed_wait)
    assert ckpt.save(2, _state(2.0), {"data_position": 2})  # returns at once, like an async save
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.stage(3, _state(3.0), {"data_position": 3})
        ckpt.commit()  # the previous outcome is checked when the next save is handed over
    err = e.value
    line = str(err)
    assert "\n" not in line and line.startswith("checkpoint save failed: step 2 could not be written to ")
    assert str(tmp_path / "checkpoints" / "2") in line and "No space left on device (errno 28)" in line
    assert "the last good checkpoint is step 1" in line
    assert (err.step, err.last_good_step, err.path) == (2, 1, tmp_path / "checkpoints" / "2")
    assert err.__cause__ is NO_SPACE
    ckpt.wait()  # reported once: wait and close stay quiet
    with pytest.raises(CheckpointSaveError, match="step 2 could not be written"):
        ckpt.save(4, _state(4.0), {"data_position": 4})  # but the run cannot go on saving as if nothing happened
    monkeypatch.undo()
    ckpt.close()
    restored, meta = Checkpointer(tmp_path).restore_latest(_abstract(_state()))
    assert meta["step"] == 1
    _assert_equal(_state(1.0), restored)


def test_sync_save_failure_is_one_line_and_close_reports_an_unseen_one(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(1.0), {"data_position": 1})

    def no_space(step, args=None, force=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.manager, "save", no_space)
    with pytest.raises(CheckpointSaveError, match=r"step 2 .*: No space left on device \(errno 28\); the last good "):
        ckpt.save(2, _state(2.0), {"data_position": 2})
    ckpt.close()
    # A failure first seen by close() is raised there.
    ckpt = Checkpointer(tmp_path / "b", async_save=True)
    monkeypatch.setattr(ckpt.manager, "save", lambda step, args=None, force=False: True)
    monkeypatch.setattr(ckpt.manager, "wait_until_finished", lambda: (_ for _ in ()).throw(NO_SPACE))
    ckpt.save(1, _state(1.0), {"data_position": 1})
    with pytest.raises(CheckpointSaveError, match="step 1 .*no earlier checkpoint exists"):
        ckpt.close()


def test_orbax_noise_is_held_then_replayed_or_dropped_and_nothing_else_is_hidden(tmp_path, caplog, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    watch = ckpt._noise
    hub = watch.hub  # the process's checkpoint_noise filter
    seen = []
    monkeypatch.setattr(hub, "previous_hook", seen.append)
    monkeypatch.setattr(hub, "watches", [watch])  # not the watches other tests left behind
    absl = logging.getLogger("absl")
    ours = f"write failed in {ckpt.directory}/3.orbax-checkpoint-tmp"

    def loop_closed():
        return types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), exc_traceback=None,
                                     exc_type=RuntimeError, err_msg=None, object=None)  # fmt: skip

    def orbax_log(msg):  # a record Orbax's own code logs; the OSError of a failed metadata write names no file
        path = os.path.join("site-packages", "orbax", "checkpoint", "_src", "checkpointers", "async_checkpointer.py")
        absl.handle(logging.LogRecord("absl", logging.ERROR, path, 1, msg, None, None))

    enospc = "[Errno 28] No space left on device"
    caplog.set_level(logging.ERROR)
    watch.begin()  # a save in flight: its noise waits
    absl.error(ours)
    orbax_log(enospc)
    absl.error("an unrelated error")
    sys.unraisablehook(loop_closed())
    assert [r.getMessage() for r in caplog.records] == ["an unrelated error"] and seen == []
    watch.end(ok=True)  # it succeeded: nothing is hidden
    assert [r.getMessage() for r in caplog.records] == ["an unrelated error", ours, enospc] and len(seen) == 1
    caplog.clear()
    watch.begin()
    absl.error(ours)
    sys.unraisablehook(loop_closed())
    watch.end(ok=False, step=3)  # it failed and was reported: its noise goes, now and later
    watch.begin()  # the next operation (say restoring step 2) succeeds while step 3's late callbacks come in
    absl.error(ours)
    about_2 = f"slow read of {ckpt.directory}/2/state"
    absl.error(about_2)
    watch.end(ok=True)
    assert [r.getMessage() for r in caplog.records] == [about_2]
    caplog.clear()
    absl.error(ours)
    orbax_log(enospc)  # the failed save's late report, after the failure was reported: dropped
    sys.unraisablehook(loop_closed())
    other = types.SimpleNamespace(exc_value=ValueError("not ours"), exc_traceback=None, exc_type=ValueError,
                                  err_msg=None, object=None)  # fmt: skip
    sys.unraisablehook(other)
    absl.error("an unrelated error")
    assert [r.getMessage() for r in caplog.records] == ["an unrelated error"] and seen[1:] == [other]
    ckpt.close()


# ---------------------------------------------------------------- A real full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 40 MB tmpfs (needs root, as in CI): saves fail there with ENOSPC like on a full disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40M", "tmpfs", str(disk)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command: the disk-full test needs a small tmpfs")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}): the disk-full test needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


DISK_FULL_SCRIPT = textwrap.dedent("""
    import logging, shutil, sys
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from reve_jax.checkpoint import Checkpointer, CheckpointSaveError
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # as the trainer logs: Orbax's errors would show
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    workdir, how = sys.argv[1], sys.argv[2]
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, PartitionSpec("d"))
    def state(step):  # 12 MiB of random floats: nothing to compress
        return {f"w{i}": jax.device_put(jax.random.normal(jax.random.key(100 * step + i), (256, 1024)), shard)
                for i in range(12)}
    ckpt = Checkpointer(workdir, keep=3, async_save=True)
    ckpt.save(1, state(1), {"data_position": 1})
    ckpt.wait()
    free = shutil.disk_usage(workdir).free
    with open(workdir + "/filler", "wb") as f:  # leave room for small files, not for a checkpoint
        f.write(b"x" * (free - 3 * 2**20))
    try:
        if how == "stage":
            ckpt.stage(2, state(2), {"data_position": 2})
            ckpt.commit()
            ckpt.stage(3, state(3), {"data_position": 3})
            ckpt.commit()
        else:
            ckpt.save(2, state(2), {"data_position": 2})
            ckpt.save(3, state(3), {"data_position": 3})
        ckpt.close()
    except CheckpointSaveError as e:
        ckpt.close()
        sys.exit(f"error: {e}")
    print("no error", flush=True)
""")


@pytest.mark.parametrize("how", ["save", "stage"])
def test_disk_full_is_one_line_and_the_run_resumes_once_space_is_freed(small_disk, how):
    workdir = small_disk / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    proc = subprocess.run(
        [sys.executable, "-c", DISK_FULL_SCRIPT, str(workdir), how],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-5000:]
    for noise in ("Traceback", "never retrieved", "Event loop is closed", "Exception ignored"):
        assert noise not in proc.stderr, proc.stderr[-5000:]
    assert len(lines) == 1, proc.stderr[-5000:]
    (line,) = lines
    assert line.startswith("error: checkpoint save failed: step 2 could not be written to "), line
    assert str(workdir / "checkpoints" / "2") in line and "No space left on device" in line
    assert "the last good checkpoint is step 1" in line
    # Nothing saved before is lost: once space is freed the run resumes from step 1 and saves again.
    (workdir / "filler").unlink()
    ckpt = Checkpointer(workdir, keep=3)
    abstract = {f"w{i}": jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=NamedSharding(_mesh(),
                PartitionSpec("d"))) for i in range(12)}  # fmt: skip
    state, meta = resume(ckpt, abstract)
    assert meta["step"] == 1
    np.testing.assert_array_equal(np.asarray(state["w3"]), np.asarray(jax.random.normal(jax.random.key(103),
                                  (256, 1024))))  # fmt: skip
    ckpt.save(2, state, {"data_position": 2})
    ckpt.close()
    assert Checkpointer(workdir).steps() == [1, 2]


# ---------------------------------------------------------------- Through scripts/train.py (needs the trainer wiring)
def _train(workdir, *extra, timeout=300):
    cmd = [sys.executable, "scripts/train.py", "--config", "configs/tiny.py", "--workdir", str(workdir)]
    cmd += [f"--config.{o}" for o in TINY] + list(extra)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_train_script_refuses_twice_when_every_checkpoint_is_corrupt_and_fresh_starts_over(tmp_path):
    first = _train(tmp_path, "--config.train.steps=2", "--config.train.ckpt_every=1")
    assert first.returncode == 0, first.stderr[-3000:]
    _corrupt_all(tmp_path)
    before = _file_contents(tmp_path / "checkpoints")
    summary = (tmp_path / "summary.json").read_text()
    for _ in range(2):
        refused = _train(tmp_path, "--config.train.steps=4")
        assert refused.returncode != 0, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert "could be restored" in refused.stderr and "--fresh" in refused.stderr, refused.stderr[-3000:]
        assert _file_contents(tmp_path / "checkpoints_corrupt") == before  # set aside, nothing lost
        assert (tmp_path / "summary.json").read_text() == summary  # no run started
    fresh = _train(tmp_path, "--config.train.steps=2", "--fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 0
    (kept,) = (tmp_path / "checkpoints_replaced").iterdir()
    assert _file_contents(kept / "checkpoints_corrupt") == before
    assert Checkpointer(tmp_path).steps()[-1] == 2


@pytest.mark.slow
def test_train_script_disk_full_stops_with_one_line(small_disk):
    workdir = small_disk / "run"
    first = _train(workdir, "--config.train.steps=2")  # the test model: its checkpoint is about 0.8 MB
    assert first.returncode == 0, first.stderr[-3000:]
    room = 2**18  # for logs and metrics, not for another checkpoint
    size = sum(p.stat().st_size for p in (workdir / "checkpoints" / "2").rglob("*") if p.is_file())
    assert size > 2 * room, size
    free = shutil.disk_usage(workdir).free
    with open(small_disk / "filler", "wb") as f:
        f.write(b"x" * (free - room))
    full = _train(workdir, "--config.train.steps=4", "--config.train.ckpt_async=True")
    assert full.returncode != 0, full.stderr[-3000:]
    for noise in ("Traceback", "never retrieved", "Event loop is closed", "Exception ignored"):
        assert noise not in full.stderr, full.stderr[-5000:]
    errors = [ln for ln in full.stderr.splitlines() if "checkpoint save failed" in ln]
    assert len(errors) == 1 and full.stderr.strip().splitlines()[-1] == errors[0], full.stderr[-5000:]
    assert str(workdir / "checkpoints" / "4") in errors[0] and "No space left on device" in errors[0]
    assert "the last good checkpoint is step 2" in errors[0]
    assert Checkpointer(workdir).steps() == [2]


# ---------------------------------------------------------------- Processes
BARRIER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax
    from reve_jax import checkpoint
    port, index = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, index, heartbeat_timeout_seconds=30)
    checkpoint._barrier("both_arrive", timeout_s=60)
    print("PASSED", flush=True)
    if index == 1:
        time.sleep(20)  # never reaches the next barrier
        os._exit(0)
    t0 = time.time()
    try:
        checkpoint._barrier("one_missing", timeout_s=2)
        print("NO TIMEOUT", flush=True)
    except checkpoint.CheckpointError as e:
        print(f"REFUSED after {time.time() - t0:.0f}s: {e}", flush=True)
    os._exit(0)
""")


@pytest.mark.slow
def test_the_barrier_between_processes_times_out_instead_of_hanging():
    port = backends.free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER_SCRIPT, str(port), str(i)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        out0 = procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            p.kill()
    assert "PASSED" in out0 and "REFUSED after" in out0, out0[-3000:]
    assert "not every process arrived" in out0 and "'one_missing'" in out0
    assert int(out0.split("REFUSED after ")[1].split("s")[0]) < 30


def test_a_permission_error_is_not_damage_where_pathlib_would_hide_it(tmp_path, monkeypatch):
    """Finding 10: the tree metadata's presence was checked with Path.is_file(), which raises EACCES on this
    Python but returns False on one whose pathlib swallows every OSError (3.14's does): the checkpoint was then
    "missing its metadata", taken for damaged and moved aside. Here is_file() swallows, and the metadata cannot be
    read (EACCES): nothing may be moved."""
    _saved(tmp_path)
    before = _files(tmp_path)
    metadata = str(tmp_path / "checkpoints" / "2" / "state" / "_METADATA")
    real_stat = os.stat

    def stat(path, *a, **kw):
        if os.fspath(path) == metadata:
            raise PermissionError(errno.EACCES, "Permission denied", metadata)
        return real_stat(path, *a, **kw)

    def swallowing_is_file(self):
        try:
            return os.path.isfile(self)  # False on any OSError
        except OSError:
            return False

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(Path, "is_file", swallowing_is_file)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointRestoreError, match="Permission denied.*nothing was moved"):
        ckpt.restore_latest(_abstract(_state()))
    monkeypatch.undo()
    assert _files(tmp_path) == before and not (tmp_path / "checkpoints_corrupt").exists()

"""Checkpoints: an Orbax CheckpointManager holding the train state (params, optimizer state, EMA, step, rng) and a
JSON item (step, data position, config, mesh) beside it, under `<workdir>/checkpoints/<step>/`.

What is never lost. Orbax writes each step into a temporary directory and renames it when complete, so a crash
during a save leaves the previous checkpoint as the latest complete one. A save that fails (disk full, I/O error)
raises `CheckpointSaveError` once, with one line naming the path, the cause and the last good step, and deletes
nothing (what Orbax prints about the failure by itself is held back: checkpoint_noise.py). On restore a checkpoint
is moved aside into `<workdir>/checkpoints_corrupt/` (never deleted) only when its files cannot be decoded
(`is_corruption`); an out-of-memory, timeout or I/O error moves nothing and propagates, and so does a saved tree
that differs from the state being restored (`check_structure`). In a job of several processes each reads only
its own shards, so they first agree, step by step, through the coordination service: a step is restored only if
every process restored it, set aside only if some process found it undecodable and none failed otherwise, and
only then does process 0 move anything (the others wait for it at a barrier named after those steps). `resume`
is the trainer's entry point: it never starts a workdir with history over at step 0 unless asked (`fresh=True`),
and then keeps the old checkpoints under `<workdir>/checkpoints_replaced/`.

Restoring onto a different mesh works by passing abstract targets that carry the new shardings.

A save blocks the caller while Orbax copies the arrays off the device (the files are written in the background).
`stage` + `commit` move that copy behind the following train step: `stage` snapshots the state on the device (so
the next step may donate the original buffers) and starts an asynchronous copy of the snapshot into pinned host
memory; `commit`, called once the next step is dispatched, hands the host arrays to Orbax, which then blocks
only for what is left of the copy. The price is one extra copy of the state in device memory until the copy
is done.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import shutil
import stat
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from reve_jax import checkpoint_noise, treepath

ORBAX_TMP = ".orbax-checkpoint-tmp"  # in the name of a step directory Orbax is writing (its TMP_DIR_SUFFIX)

log = logging.getLogger(__name__)

BARRIER_TIMEOUT_S = 600  # a process that never reaches a barrier is dead; fail instead of hanging forever


@jax.jit
def _device_copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _host_shardings(tree):
    """Each leaf's sharding in pinned host memory (where the device-to-host copy is fastest)."""
    return jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), tree)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required, or checkpoints that must not be used as they are."""


class StructureMismatchError(CheckpointError):
    """The saved tree differs from the state being restored (paths, shapes or dtypes); nothing was moved."""


class CheckpointRestoreError(CheckpointError):
    """A restore failed for a reason other than damaged files (memory, I/O, timeout); nothing was moved."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, I/O error). `str()` is one line: the path, the cause and the last good step."""

    def __init__(self, message: str, *, step: int, path: Path, cause: str, last_good_step: int | None):
        super().__init__(message)
        self.step, self.path, self.cause, self.last_good_step = step, path, cause, last_good_step


# ---------------------------------------------------------------- What counts as damaged files
# Tensorstore (under Orbax) raises ValueError("CODE: ...") with an absl status code. These codes mean the bytes on
# disk could not be decoded: truncated or missing chunks, a garbled manifest, invalid JSON.
_DECODE_CODES = {"DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT"}
# These mean the environment failed (memory, quota, permissions, a slow or absent file system): the files may
# well be fine, and moving them aside would make the next launch start over.
_ENVIRONMENT_CODES = {
    "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "ABORTED", "CANCELLED",
    "INTERNAL", "UNKNOWN", "UNIMPLEMENTED", "UNAUTHENTICATED", "ALREADY_EXISTS",
}  # fmt: skip
_CODE = re.compile(r"(?:^|[\s(\[])([A-Z][A-Z_]{4,}):")
_OS_ERRNO = re.compile(r"os_error_code='(\d+)'|\[OS error (\d+)")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (Orbax wraps tensorstore's errors in a bare Exception)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen and len(out) < 32:
        out.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


def _is_device_error(exc: BaseException) -> bool:
    """JAX/XLA runtime errors (device out of memory and the like); matched by name across jax versions."""
    return any(c.__name__ in ("JaxRuntimeError", "XlaRuntimeError") for c in type(exc).__mro__)


def is_corruption(exc: BaseException) -> bool:
    """Whether a restore failure means the checkpoint's files cannot be decoded (missing or truncated files,
    unparseable metadata, tensorstore/zarr decode errors), so the checkpoint may be set aside.

    Anything that points at the environment instead wins: out of memory (MemoryError, a JAX runtime error such as
    RESOURCE_EXHAUSTED), timeouts, OS errors other than a missing file (EIO, ENOSPC, EACCES, ESTALE), and
    tensorstore codes such as RESOURCE_EXHAUSTED or UNAVAILABLE. So does our own StructureMismatchError. Unknown
    errors are not corruption: refusing to start is recoverable, moving good checkpoints aside is not.
    """
    chain = _chain(exc)
    texts = [str(e)[:4000] for e in chain]
    for e, text in zip(chain, texts, strict=True):
        if isinstance(e, (CheckpointError, MemoryError)) or _is_device_error(e):
            return False
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):  # includes TimeoutError
            return False
        if _ENVIRONMENT_CODES.intersection(_CODE.findall(text)):
            return False
        if any(int(a or b) != 2 for a, b in _OS_ERRNO.findall(text)):  # an OS error other than ENOENT
            return False
    for e, text in zip(chain, texts, strict=True):
        if isinstance(e, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError)):
            return True
        if isinstance(e, KeyError) and ("not found in the checkpoint" in text or "Unknown key" in text):
            return True  # a whole item directory is missing
        if type(e).__module__.startswith("msgpack"):
            return True
        if _DECODE_CODES.intersection(_CODE.findall(text)):
            return True
    return False


# ---------------------------------------------------------------- Structure
def _dtype_str(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes (typed PRNG keys)
        return str(dtype)


def _leaf_specs(tree) -> dict[str, tuple[tuple, str]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is not None:
            out[treepath.to_str(path)] = (tuple(shape), _dtype_str(leaf.dtype))
    return out


def structure_differences(saved: dict, wanted: dict) -> list[str]:
    """Human-readable differences between two {path: (shape, dtype)} maps, sorted by path."""
    diffs = []
    for p in sorted(set(saved) | set(wanted)):
        if p not in saved:
            diffs.append(f"{p} missing from the checkpoint")
        elif p not in wanted:
            diffs.append(f"{p} in the checkpoint but not in this state")
        elif saved[p][0] != wanted[p][0]:
            diffs.append(f"{p} shape saved {saved[p][0]}, now {wanted[p][0]}")
        elif saved[p][1] != wanted[p][1]:
            diffs.append(f"{p} dtype saved {saved[p][1]}, now {wanted[p][1]}")
    return diffs


# ---------------------------------------------------------------- Processes
def _barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S):
    """Wait for every process, with a timeout (sync_global_devices has none: a dead peer would hang us)."""
    if jax.process_count() == 1:
        return
    try:
        from jax._src.distributed import global_state

        client = global_state.client
    except ImportError:  # a jax without the coordination-service client
        client = None
    if client is not None:
        try:
            client.wait_at_barrier(name, int(timeout_s * 1000))
        except Exception as e:  # DEADLINE_EXCEEDED, or a peer that left the job
            raise CheckpointError(
                f"process {jax.process_index()} waited {timeout_s:.0f}s at the checkpoint barrier {name!r} and not "
                f"every process arrived ({str(e)[:300]}); a peer probably died: relaunch the job"
            ) from e
    else:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# Each process makes the same sequence of agreements (restore_latest calls), so the n-th of one is the n-th of all.
_agreements = itertools.count()


def _all_processes(key: str, value: str, timeout_s: float = BARRIER_TIMEOUT_S) -> list[str]:
    """Every process's `value` for `key` (used once per job), in process order, through the coordination
    service's key-value store; [value] for one process. Raises CheckpointError when a process does not answer in
    time (it died: the job must be relaunched)."""
    if jax.process_count() == 1:
        return [value]
    from jax._src.distributed import global_state

    client, me = global_state.client, jax.process_index()
    if client is None:
        raise CheckpointError("a restore across processes needs jax.distributed's coordination service")
    client.key_value_set(f"{key}/{me}", value)
    try:
        return [client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)) for p in range(jax.process_count())]
    except Exception as e:  # DEADLINE_EXCEEDED, or a peer that left the job
        raise CheckpointError(
            f"process {me} waited {timeout_s:.0f}s for every process's answer to {key!r} and not every process "
            f"answered ({str(e)[:300]}); a peer probably died: relaunch the job"
        ) from e


def _stat_file(path: Path) -> None:
    """Raises FileNotFoundError when `path` is missing or not a file, and any other OSError (EACCES, EIO) as it
    is: an environment failure, never taken for damage. Path.is_file() may swallow those (Python 3.14 does)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(errno.ENOENT, "Not a regular file", str(path))


def _short_cause(exc: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error when there is one, else the first line."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} (errno {e.errno})"
        for a, b in _OS_ERRNO.findall(str(e)):
            return f"{os.strerror(int(a or b))} (errno {int(a or b)})"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


_CPU_HANDLER = False  # registered in this process


def _no_replica_parallel_on_cpu() -> None:
    """On CPU, save each array from one replica. Orbax's default splits a replicated array into one slice per
    replica and copies each to the host apart, to spread device-to-host copies over accelerators (it turns this off
    itself when JAX_PLATFORMS names a GPU); CPU devices are host memory already, and every slice is a dispatched
    (at first, compiled) slice program: the first save of a 70k-parameter state on 8 CPU devices took 6.9 s (2,288
    slices), later ones 1.3 s. Process-wide (Orbax's handler registry); a no-op on other platforms."""
    global _CPU_HANDLER
    if _CPU_HANDLER or jax.default_backend() != "cpu":
        return
    _CPU_HANDLER = True
    # Orbax's own default handler but for the option (its registry, without the warning that it is replaced).
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import type_handler_registry

    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False
    )
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(jax.Array, handler, override=True, ignore_warnings=True)


class Checkpointer:
    """Save and restore `state` pytrees plus JSON metadata under `<workdir>/checkpoints/<step>/`."""

    def __init__(self, workdir: str | Path, keep: int = 3, async_save: bool = True, *, reader: bool = False):
        """`reader`: opened to read a run that may be training elsewhere (sampling, scoring, conversion): it leaves
        the directory's temporary save directories alone (one may be the running trainer's save)."""
        self.workdir = Path(workdir).absolute()
        self.reader = reader
        self.directory = self.workdir / "checkpoints"
        self.corrupt_dir = self.workdir / "checkpoints_corrupt"
        self.replaced_dir = self.workdir / "checkpoints_replaced"
        self.keep, self.async_save = keep, async_save
        self._staged: tuple[int, object, dict] | None = None
        self._pending: int | None = None  # the step of an async save not yet known to be complete
        self._failure: CheckpointSaveError | None = None
        self._barriers = 0
        self._noise = checkpoint_noise.watch(self.directory)
        self._open()

    def _open(self):
        _no_replica_parallel_on_cpu()
        self._remove_failed_saves()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=True, enable_async_checkpointing=self.async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def _remove_failed_saves(self):
        """A save that failed (disk full, a process killed) leaves its temporary directory: process 0 removes it
        when the checkpoints are opened, before anything is written. Done here and synchronously: Orbax's own
        `cleanup_tmp_directories` runs in a background thread that a process exiting soon after (a refusal) cuts
        off with a traceback."""
        if self.reader or jax.process_index() != 0 or not self.directory.is_dir():
            return
        for p in self.directory.iterdir():
            if ORBAX_TMP in p.name:
                log.info("removing %s, the temporary directory of a save that did not complete", p)
                shutil.rmtree(p, ignore_errors=True)

    def _sync(self, what: str):
        # Every process makes the same calls in the same order, so the names agree; the directory's hash keeps
        # two Checkpointers of one job apart (a barrier name is used once).
        self._barriers += 1
        _barrier(f"reve_jax_checkpoint_{self._tag():08x}_{what}_{self._barriers}")

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def _disk_steps(self) -> list[int]:
        """Complete checkpoints as the directory shows them (Orbax's temporary directories have a suffix)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    def has_history(self) -> bool:
        """Whether this workdir ever held a checkpoint: a complete step in checkpoints/ or anything set aside in
        checkpoints_corrupt/. A run in such a workdir must resume, not start over (see `resume`)."""
        return bool(self._disk_steps()) or (self.corrupt_dir.is_dir() and any(self.corrupt_dir.iterdir()))

    # ------------------------------------------------------------ Save
    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving `state` (a pytree of jax.Arrays) and `meta` (JSON-able) at `step`; returns whether a save
        started. Async: the arrays are copied off the device before this returns, the files land in the
        background; `wait()` blocks until they are complete. Raises CheckpointSaveError when this save or the
        previous one failed."""
        self.commit()  # an older staged save goes first: steps stay in order
        self._settle()
        if step in self.manager.all_steps():
            return False
        meta = dict(meta, step=int(step), saved_at=time.time())
        self._noise.begin()
        try:
            started = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as e:
            self._fail(step, e)
        if not started:
            self._noise.end(ok=True)
            return False
        self._pending = step
        if not self.async_save:
            self._settle()  # already complete: check that it landed
        return True

    def stage(self, step: int, state, meta: dict) -> bool:
        """Start a save of `state` at `step` whose device-to-host copy overlaps what the caller runs next; returns
        whether one was staged. Call `commit()` after dispatching the next step (save, wait and close commit too).
        """
        self.commit()
        self._raise_if_failed()  # the previous save's outcome is checked at commit: stage must not wait for it
        if step in self.manager.all_steps():
            return False
        snapshot = _device_copy(state)  # the caller may donate `state` to its next step
        host = jax.device_put(snapshot, _host_shardings(snapshot))
        self._staged = (step, host, meta)
        return True

    def commit(self) -> bool:
        """Hand a staged save to Orbax (blocks for the rest of its host copy); False when nothing was staged."""
        if self._staged is None:
            return False
        step, host, meta = self._staged
        self._staged = None
        return self.save(step, host, meta)

    @property
    def staged_step(self) -> int | None:
        return None if self._staged is None else self._staged[0]

    def _settle(self):
        """Wait for the save in flight and check that it landed; a failure raises CheckpointSaveError. After a
        failure every later save raises again (the run must stop), while wait/close stay quiet."""
        self._raise_if_failed()
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._fail(step, e)
        if not (self.directory / str(step)).is_dir():  # Orbax may log an error and skip the final rename
            self._fail(step, RuntimeError(self._noise.first_error() or "Orbax did not finalize the checkpoint"))
        self._noise.end(ok=True)

    def _raise_if_failed(self):
        f = self._failure
        if f is not None:
            raise CheckpointSaveError(str(f), step=f.step, path=f.path, cause=f.cause, last_good_step=f.last_good_step)

    def _fail(self, step: int, exc: BaseException):
        self._noise.end(ok=False, step=step)  # what Orbax printed about it is dropped: this error says it once
        last = self._disk_steps()
        last_good = last[-1] if last else None
        path = self.directory / str(step)
        cause = _short_cause(exc)
        then = (
            f"the last good checkpoint is step {last_good} in {self.directory}; nothing was deleted, and once the "
            f"cause is fixed a relaunch resumes from step {last_good}"
            if last_good is not None
            else "no earlier checkpoint exists"
        )
        self._failure = CheckpointSaveError(
            f"checkpoint save failed: step {step} could not be written to {path}: {cause}; {then}",
            step=step,
            path=path,
            cause=cause,
            last_good_step=last_good,
        )
        raise self._failure from exc

    def wait(self):
        """Block until the saves started so far are complete; raises CheckpointSaveError if one failed (once)."""
        if self._failure is not None:
            return
        self.commit()
        self._settle()

    def close(self):
        """Commit and complete outstanding saves, then release Orbax's threads. Raises CheckpointSaveError only
        for a failure not reported before."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:
                if self._failure is None:  # a failure already reported is not reported twice
                    raise
            self._noise.close()

    # ------------------------------------------------------------ Restore
    # Reads go through Orbax's handlers, not the manager: the manager ends every restore with a barrier across
    # processes that has no timeout (sync_global_devices), so one process that fails to read its shards would
    # hang the others there before they could agree on what failed (restore_latest agrees, with a timeout).
    def restore_meta(self, step: int) -> dict:
        handler = ocp.JsonCheckpointHandler()
        try:
            return dict(handler.restore(epath.Path(self.directory / str(step) / "meta")))
        finally:
            handler.close()

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """Restore checkpoint `step` onto the shardings carried by `abstract_state`; returns (state, meta). Raises
        whatever Orbax raises for unreadable files (nothing is moved). No barrier between processes."""
        handler = ocp.StandardCheckpointHandler()
        try:
            state_dir = epath.Path(self.directory / str(step) / "state")
            state = handler.restore(state_dir, args=ocp.args.StandardRestore(abstract_state))
        finally:
            handler.close()
        return state, self.restore_meta(step)

    def saved_structure(self, step: int) -> dict[str, tuple[tuple, str]]:
        """{path: (shape, dtype)} of checkpoint `step`'s state, from Orbax's tree metadata (no array is read).
        Raises what reading the metadata raises (FileNotFoundError when the metadata file is missing)."""
        state_dir = self.directory / str(step) / "state"
        _stat_file(state_dir / "_METADATA")
        handler = ocp.StandardCheckpointHandler()
        try:
            return _leaf_specs(handler.metadata(epath.Path(state_dir)))
        finally:
            handler.close()

    def check_structure(self, step: int, abstract_state) -> None:
        """Raise StructureMismatchError naming the differing paths when checkpoint `step` does not hold a tree of
        the paths, shapes and dtypes of `abstract_state`. Moves nothing."""
        diffs = structure_differences(self.saved_structure(step), _leaf_specs(abstract_state))
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise StructureMismatchError(
                f"checkpoint {step} in {self.directory} does not match the train state of this config "
                f"({len(diffs)} differences: {shown}). Resume with the config it was written with, convert the "
                f"workdir with scripts/convert_checkpoint.py, or train in a new --workdir. Nothing was moved."
            )

    def restore_latest(self, abstract_state) -> tuple[object, dict] | None:
        """Restore the newest checkpoint that loads, onto the shardings carried by `abstract_state` (a pytree of
        jax.ShapeDtypeStruct with `sharding`). Returns (state, meta), or None when checkpoints/ holds none.

        A checkpoint whose files cannot be decoded (`is_corruption`) is moved to checkpoints_corrupt/ and the
        previous one is tried; when none is left, CheckpointError says what to do. A structure mismatch raises
        StructureMismatchError, any other failure CheckpointRestoreError; both move nothing. Every process of a
        job reaches the same verdict on every step (module docstring)."""
        round_ = f"reve_jax_restore_{self._tag():08x}_{next(_agreements)}"
        mine = self.steps()
        seen = [set(json.loads(v)) for v in _all_processes(f"{round_}/steps", json.dumps(mine))]
        steps = sorted(set.intersection(*seen))
        if steps != mine:
            log.warning(
                "steps %s are not complete on every process; restoring from %s", sorted(set(mine) - set(steps)), steps
            )
        bad = []
        for step in reversed(steps):
            self._noise.begin()
            result, error, verdict = None, None, "ok"
            try:
                self.check_structure(step, abstract_state)
                result = self.restore(step, abstract_state)
            except Exception as e:
                error = e
                verdict = "corrupt" if is_corruption(e) else "error"
            answers = [json.loads(v) for v in _all_processes(f"{round_}/{step}", json.dumps([verdict, _brief(error)]))]
            if all(v == "ok" for v, _ in answers):
                self._noise.end(ok=True)
                if bad:
                    self._quarantine(bad)
                return result
            self._noise.end(ok=False, step=step)
            others = [(p, why) for p, (v, why) in enumerate(answers) if v == "error"]
            if verdict == "error" or others:  # the environment, not the files (here or elsewhere): move nothing
                if isinstance(error, StructureMismatchError):
                    raise error
                where, why = (
                    ("", _brief(error)) if verdict == "error" else (f" on process {others[0][0]}", others[0][1])
                )
                raise CheckpointRestoreError(
                    f"checkpoint {step} in {self.directory} could not be restored{where} ({why}). That is not damage "
                    f"to its files, so nothing was moved: fix the cause (memory, disk, permissions, a slow file "
                    f"system) and relaunch."
                ) from error
            damaged = [p for p, (v, _) in enumerate(answers) if v == "corrupt"]
            why = next(why for v, why in answers if v == "corrupt")
            log.warning(
                "checkpoint %d in %s cannot be decoded (on process(es) %s: %s); setting it aside and trying the "
                "previous one",
                step, self.directory, damaged, why,
            )  # fmt: skip
            bad.append(step)
        if bad:
            self._quarantine(bad)
            raise CheckpointError(self.nothing_restorable_message())
        return None

    def _tag(self) -> int:
        return zlib.crc32(str(self.directory).encode())

    def nothing_restorable_message(self) -> str:
        n = len(list(self.corrupt_dir.iterdir())) if self.corrupt_dir.is_dir() else 0
        return (
            f"no checkpoint in {self.workdir} could be restored; {n} were set aside in {self.corrupt_dir}. Repair "
            f"or remove them, or pass --fresh to start over at step 0 (the old checkpoints are kept in "
            f"{self.replaced_dir}/)."
        )

    def _quarantine(self, steps: list[int]):
        """Move undecodable checkpoints out of the manager's directory so a later save at the same step works."""
        self.manager.close()
        if jax.process_index() == 0:
            self.corrupt_dir.mkdir(parents=True, exist_ok=True)
            for step in steps:
                src = self.directory / str(step)
                if src.exists():
                    shutil.move(str(src), str(self.corrupt_dir / f"{step}.{int(time.time())}"))
        self._sync("quarantine_" + "_".join(map(str, steps)))  # every process agreed on these steps
        self._open()

    def replace_history(self) -> Path | None:
        """Move checkpoints/ and checkpoints_corrupt/ into checkpoints_replaced/<UTC time>/ (nothing is deleted)
        and reopen an empty checkpoints/; returns where they went (None when there was nothing to move)."""
        self.wait()
        self.manager.close()
        dest = None
        if jax.process_index() == 0 and self.has_history():
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            dest = self.replaced_dir / stamp
            n = 1
            while dest.exists():
                n += 1
                dest = self.replaced_dir / f"{stamp}.{n}"
            dest.mkdir(parents=True)
            for src in (self.directory, self.corrupt_dir):
                if src.exists():
                    shutil.move(str(src), str(dest / src.name))
        self._sync("replace")
        self._open()
        return dest


def _brief(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {str(exc)[:500]}"


def resume(ckpt: Checkpointer, abstract_state, *, fresh: bool = False) -> tuple[object, dict] | None:
    """The trainer's start: (state, meta) of the newest restorable checkpoint, or None to start at step 0.

    None only when the workdir has no history (`Checkpointer.has_history`) or when `fresh` is set; with `fresh`,
    existing checkpoints (and set-aside ones) are first moved into checkpoints_replaced/<UTC time>/. Without
    `fresh`, a workdir with history but nothing restorable raises CheckpointError on every launch, so a supervisor
    that relaunches by itself never starts the run over. Errors of `restore_latest` propagate.
    """
    if fresh:
        dest = ckpt.replace_history()
        if dest is not None:
            log.info("--fresh: starting at step 0; the previous checkpoints were moved to %s", dest)
        return None
    result = ckpt.restore_latest(abstract_state)
    if result is None and ckpt.has_history():
        raise CheckpointError(ckpt.nothing_restorable_message())
    return result

"""Checkpoints: an Orbax CheckpointManager holding the train state (params, optimizer state, EMA, step, rng) and a
JSON item (step, data position, config, mesh) beside it.

Orbax writes each step into a temporary directory and renames it when complete, so a crash during a save leaves
the previous checkpoint as the latest complete one. A checkpoint that fails to restore (corrupt or truncated
files) is moved aside into `<workdir>/checkpoints_corrupt/` (never deleted) and the one before is used.
Restoring onto a different mesh works by passing abstract targets that carry the new shardings.

A save blocks the caller while Orbax copies the arrays off the device (the files are written in the background).
`stage` + `commit` move that copy behind the following train step: `stage` snapshots the state on the device (so
the next step may donate the original buffers) and starts an asynchronous copy of the snapshot into pinned host
memory; `commit`, called once the next step is dispatched, hands the host arrays to Orbax, which then blocks
only for what is left of the copy. The price is one extra copy of the state in device memory until the copy
is done.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


@jax.jit
def _device_copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _host_shardings(tree):
    """Each leaf's sharding in pinned host memory (where the device-to-host copy is fastest)."""
    return jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), tree)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required."""


class Checkpointer:
    """Save and restore `state` pytrees plus JSON metadata under `<workdir>/checkpoints/<step>/`."""

    def __init__(self, workdir: str | Path, keep: int = 3, async_save: bool = True):
        self.workdir = Path(workdir).absolute()
        self.directory = self.workdir / "checkpoints"
        self.keep, self.async_save = keep, async_save
        self._staged: tuple[int, object, dict] | None = None
        self._open()

    def _open(self):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=True, enable_async_checkpointing=self.async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving `state` (a pytree of jax.Arrays) and `meta` (JSON-able) at `step`; returns whether a save
        started. Async: the arrays are copied off the device before this returns, the files land in the
        background; `wait()` blocks until they are complete."""
        self.commit()  # an older staged save goes first: steps stay in order
        if step in self.manager.all_steps():
            return False
        meta = dict(meta, step=int(step), saved_at=time.time())
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def stage(self, step: int, state, meta: dict) -> bool:
        """Start a save of `state` at `step` whose device-to-host copy overlaps what the caller runs next; returns
        whether one was staged. Call `commit()` after dispatching the next step (save, wait and close commit too).
        """
        self.commit()
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

    def wait(self):
        self.commit()
        self.manager.wait_until_finished()

    def close(self):
        self.commit()
        self.manager.wait_until_finished()
        self.manager.close()

    def restore_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """Restore checkpoint `step` onto the shardings carried by `abstract_state`; returns (state, meta). Raises
        whatever Orbax raises for unreadable files (nothing is moved)."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return restored["state"], dict(restored["meta"])

    def restore_latest(self, abstract_state) -> tuple[object, dict] | None:
        """Restore the newest checkpoint that loads, onto the shardings carried by `abstract_state` (a pytree of
        jax.ShapeDtypeStruct with `sharding`). Returns (state, meta), or None when there is no checkpoint.
        Checkpoints that fail to load are moved aside and the previous one is tried."""
        bad = []
        result = None
        for step in reversed(self.steps()):
            try:
                result = self.restore(step, abstract_state)
                break
            except Exception as e:  # any failure to read means this step is unusable; keep the files
                log.warning(
                    "checkpoint %d in %s could not be restored (%s: %s); trying the previous one",
                    step,
                    self.directory,
                    type(e).__name__,
                    str(e)[:500],
                )
                bad.append(step)
        if bad:
            self._quarantine(bad)
        if result is None and bad:
            raise CheckpointError(
                f"none of the checkpoints {bad} in {self.directory} could be restored; they were moved to "
                f"{self.workdir / 'checkpoints_corrupt'}. Start a fresh run in a new workdir or repair them."
            )
        return result

    def _quarantine(self, steps: list[int]):
        """Move unreadable checkpoints out of the manager's directory so a later save at the same step works."""
        self.manager.close()
        if jax.process_index() == 0:
            dest = self.workdir / "checkpoints_corrupt"
            dest.mkdir(parents=True, exist_ok=True)
            for step in steps:
                src = self.directory / str(step)
                if src.exists():
                    shutil.move(str(src), str(dest / f"{step}.{int(time.time())}"))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("reve_jax_checkpoint_quarantine")
        self._open()

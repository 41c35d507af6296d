"""Checkpoints: an Orbax CheckpointManager holding the train state (params, optimizer state, EMA, step, rng) and a
JSON item (step, data position, config, mesh) beside it.

Orbax writes each step into a temporary directory and renames it when complete, so a crash during a save leaves
the previous checkpoint as the latest complete one. A checkpoint that fails to restore (corrupt or truncated
files) is moved aside into `<workdir>/checkpoints_corrupt/` (never deleted) and the one before is used.
Restoring onto a different mesh works by passing abstract targets that carry the new shardings.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required."""


class Checkpointer:
    """Save and restore `state` pytrees plus JSON metadata under `<workdir>/checkpoints/<step>/`."""

    def __init__(self, workdir: str | Path, keep: int = 3, async_save: bool = True):
        self.workdir = Path(workdir).absolute()
        self.directory = self.workdir / "checkpoints"
        self.keep, self.async_save = keep, async_save
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
        if step in self.manager.all_steps():
            return False
        meta = dict(meta, step=int(step), saved_at=time.time())
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
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

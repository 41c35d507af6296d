"""Convert a workdir's newest checkpoint to another parameter layout, into a new workdir.

    python scripts/convert_checkpoint.py --workdir runs/a --out runs/a_scan --config.model.scan_layers=True

What it can change is the layout of the same weights: `model.scan_layers` (per-block `blocks/<i>/...` <->
stacked `blocks/...` with a leading layers axis) and `optim.muon_patterns` (a new pattern that labels the same
leaves). Every leaf of the new state (parameters, each EMA, the optimizer's moments and momentum buffers) is
taken from the old state by its path: the same path, or the block `i` of a stacked leaf, or the stack of the
per-block leaves; every old leaf must be used, so nothing is dropped without an error. Step, data position and
RNG carry over, so training in the new workdir continues the same run.

The source workdir is only read. The destination must hold no checkpoint. The conversion runs on one host CPU
device (the whole state in host memory), in one process.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from reve_jax import checkpoint, config, sharding, treepath
from reve_jax.train import train_state, trainer

log = logging.getLogger(__name__)

LAYOUT_KEYS = trainer.LAYOUT_KEYS  # what a conversion may change


class ConversionError(ValueError):
    """The requested conversion would change the weights, or the state does not map leaf for leaf."""


def convert_tree(source, target):
    """A tree of numpy arrays shaped like `target` (a pytree of arrays or ShapeDtypeStructs) whose leaves come from
    `source` (a pytree of arrays) by path: equal path; `.../blocks/<i>/rest` from `.../blocks/rest` [i] (unstack);
    or `.../blocks/rest` from the stack over i of `.../blocks/<i>/rest`. Raises ConversionError when a target
    leaf has no source, a shape differs, or a source leaf is left unused."""
    src = {treepath.parts(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(source)[0]}
    used: set[tuple[str, ...]] = set()

    def take(key):
        used.add(key)
        return src[key]

    def fill(path, leaf):
        key, shape = treepath.parts(path), tuple(leaf.shape)
        if key in src:
            value = take(key)
        else:
            value = None
            for j, part in enumerate(key):
                if part != "blocks":
                    continue
                head, tail = key[: j + 1], key[j + 1 :]
                if tail and tail[0].isdigit() and head + tail[1:] in src:  # per-block leaf from a stack
                    stack = src[head + tail[1:]]
                    if int(tail[0]) < stack.shape[0]:
                        used.add(head + tail[1:])
                        value = stack[int(tail[0])]
                        break
                per_block = [head + (str(i),) + tail for i in range(shape[0] if shape else 0)]
                if per_block and all(k in src for k in per_block):  # a stack from per-block leaves
                    value = np.stack([take(k) for k in per_block])
                    break
            if value is None:
                raise ConversionError(
                    f"no leaf of the old state maps to {'/'.join(key)} {shape}: the new config changes more than the "
                    f"layout (only {', '.join(LAYOUT_KEYS)} may change, and a new Muon pattern must select the "
                    "same weights)"
                )
        if tuple(value.shape) != shape:
            raise ConversionError(f"{'/'.join(key)}: the old state gives shape {value.shape}, the new needs {shape}")
        return value.astype(leaf.dtype)

    out = jax.tree_util.tree_map_with_path(fill, target)
    unused = sorted(set(src) - used)
    if unused:
        raise ConversionError(
            f"{len(unused)} leaves of the old state have no place in the new one (first: {'/'.join(unused[0])}): "
            "a new Muon pattern must select the same weights as the old one"
        )
    return out


def _host_setup(cfg):
    """The state's setup on one CPU device (all leaves whole), without loading perceptual networks."""
    cfg = copy.deepcopy(cfg)
    with cfg.unlocked():
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 1
    return train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh, jax.devices("cpu")[:1]), frozen=False)


def convert_workdir(src: str | Path, dst: str | Path, overrides: list[str] = (), *, dry_run: bool = False) -> dict:
    """Write the newest checkpoint of workdir `src`, converted to its config plus `overrides` ("a.b=v" or
    "--config.a.b=v"), as the only checkpoint of the new workdir `dst` (with its config.json). Returns a summary.
    `dry_run`: only the checks on the configs and `dst` (no array is read or written); the summary has no leaves."""
    src, dst = Path(src), Path(dst)
    if jax.process_count() > 1:
        raise ConversionError("convert in a single process (not under the elastic launcher)")
    if not (src / "checkpoints").is_dir():
        raise checkpoint.CheckpointError(f"{src} has no checkpoints/ directory: pass the workdir of a run")
    if (dst / "checkpoints").exists() and any((dst / "checkpoints").iterdir()):
        raise ConversionError(f"{dst} already holds checkpoints: choose a new --out; nothing was written")
    reader = checkpoint.Checkpointer(src, async_save=False, reader=True)
    try:
        if not reader.steps():
            raise checkpoint.CheckpointError(f"no complete checkpoint in {src / 'checkpoints'}")
        step = reader.steps()[-1]
        saved_json = reader.restore_meta(step)["config"]
        old_cfg = config.from_json(saved_json)
        new_cfg = copy.deepcopy(old_cfg)
        for item in overrides:
            config.apply_override(new_cfg, item.removeprefix("--config."))
        config.validate(new_cfg)
        changes = trainer.state_key_changes(new_cfg, saved_json)
        other = {k: v for k, v in changes.items() if k not in LAYOUT_KEYS}
        if other:
            raise ConversionError(
                "only the layout may change in a conversion ("
                + ", ".join(LAYOUT_KEYS)
                + "); these would change the weights: "
                + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in other.items())
            )
        if dry_run:
            return {"step": int(step), "leaves": None, "changed": changes}
        old_setup, new_setup = _host_setup(old_cfg), _host_setup(new_cfg)
        try:
            state, meta = reader.restore(step, old_setup.abstract_state)
        except Exception as e:
            raise checkpoint.CheckpointError(
                f"checkpoint {step} in {src} could not be read ({type(e).__name__}: {str(e)[:300]}); resume the run "
                "once to let the trainer set it aside, or pass a workdir whose newest checkpoint loads"
            ) from e
    finally:
        reader.close()
    host = convert_tree(jax.device_get(state), new_setup.abstract_state)
    replicated = NamedSharding(new_setup.mesh, PartitionSpec())
    new_state = jax.tree.map(lambda x: jax.device_put(x, replicated), host)
    dst.mkdir(parents=True, exist_ok=True)
    writer = checkpoint.Checkpointer(dst, async_save=False)
    try:
        keep = {k: v for k, v in meta.items() if k not in ("step", "saved_at")}  # save() sets these anew
        writer.save(step, new_state, dict(keep, config=config.to_json(new_cfg), converted_from=str(src.absolute())))
        writer.wait()
    finally:
        writer.close()
    (dst / "config.json").write_text(config.to_json(new_cfg))
    summary = {"step": int(step), "leaves": len(jax.tree.leaves(host)), "changed": changes}
    log.info("converted %s step %d -> %s: %s", src, step, dst, summary["changed"] or "no layout change")
    return summary

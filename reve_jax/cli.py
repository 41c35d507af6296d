"""Shared start-up for the entry scripts: logging, config errors as one clear line, the elastic worker."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from reve_jax import config


def setup_logging():
    """INFO and above to stderr. Importing orbax puts a plain stderr handler on the root logger at WARNING, which
    makes `logging.basicConfig` a no-op (every INFO line was lost): plain StreamHandlers are replaced by ours, other
    kinds (pytest's capture) are kept. Calling it twice leaves one handler."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler:
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def parse_args(parser, argv=None):
    """`parser`'s arguments plus the `--config.a.b=v` overrides every script takes the same way: returns (args,
    overrides). Anything else unrecognised is a usage error (exit 2) that shows what an override looks like."""
    args, rest = parser.parse_known_args(argv)
    bad = [o for o in rest if not o.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised arguments {bad}; config overrides look like --config.model.depth=4")
    return args, rest


def load_config_or_exit(spec: str, overrides: list[str]):
    """Load and validate a config with `--config.a.b=v` overrides; a bad one exits with status 2 and the reason."""
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        sys.exit(f"error: unrecognised arguments {bad}; config overrides look like --config.model.depth=4")
    try:
        return config.load_config(spec, overrides)
    except config.ConfigError as e:
        sys.exit(f"config error: {e}")


def dry_run_exit(what: str):
    """End a --dry-run: one line saying what the command would have done, then exit 0 (nothing was compiled or
    written)."""
    print(f"dry run: {what}", flush=True)
    sys.exit(0)


def check_mesh_or_exit(cfg, num_devices: int | None = None):
    """The (data, fsdp, tensor) mesh of `cfg.mesh` on this process's devices, or on `num_devices` devices that need
    not exist here (an abstract mesh: shapes only), with `train.global_batch` checked to split over it. A mesh that
    does not fit exits non-zero with the reason. Returns the mesh."""
    from reve_jax import sharding
    from reve_jax.train import builder

    try:
        if num_devices is None:
            mesh = sharding.make_mesh(cfg.mesh)
        else:
            from reve_jax.tools.plan.memory import abstract_mesh

            mesh = abstract_mesh(sharding.mesh_shape(cfg.mesh, num_devices))
        builder.check_batch_split(cfg, mesh)
    except sharding.MeshError as e:
        sys.exit(f"config error: {e}")
    return mesh


def describe_mesh(mesh) -> str:
    return " x ".join(f"{name} {size}" for name, size in mesh.shape.items())


def check_inputs_or_exit(cfg) -> None:
    """Every non-empty config key named `path` or `*_path` (shards, converted weights) must name an existing file
    or directory; otherwise exit non-zero naming the keys."""

    def paths(node, prefix):
        for key, value in node.items():
            if hasattr(value, "items"):
                yield from paths(value, f"{prefix}{key}.")
            elif (key == "path" or key.endswith("_path")) and isinstance(value, str) and value:
                yield f"{prefix}{key}", value

    missing = [f"{key}={value!r}" for key, value in paths(cfg, "") if not Path(value).exists()]
    if missing:
        sys.exit(f"error: input not found: {', '.join(missing)}")


def saved_config_or_exit(workdir) -> tuple[int, object]:
    """(step, config) of the newest checkpoint of run directory `workdir`, read from its metadata (no array is
    loaded); a directory without checkpoints exits non-zero."""
    from reve_jax import checkpoint

    if not (Path(workdir) / "checkpoints").is_dir():  # checked first: opening a Checkpointer creates the folder
        sys.exit(f"error: {workdir} holds no checkpoints/: pass the workdir of a run")
    ckpt = checkpoint.Checkpointer(workdir, async_save=False, reader=True)
    try:
        if not ckpt.steps():
            sys.exit(f"error: no complete checkpoint in {Path(workdir) / 'checkpoints'}")
        step = ckpt.steps()[-1]
        return step, config.from_json(ckpt.restore_meta(step)["config"])
    finally:
        ckpt.close()


def start_worker():
    """Join the elastic job when launched by the supervisor (REVE_* variables), else a plain local run.
    Must run before JAX touches its devices."""
    setup_logging()
    if "REVE_NUM_PROCESSES" not in os.environ:
        return None
    from reve_jax.elastic import worker

    return worker.init_from_env()


def train(cfg, workdir, worker, *, fresh: bool = False):
    """Run the trainer; an error the user can act on (a config that does not fit the mesh, a checkpoint that
    cannot be restored or saved) exits non-zero with its one-line message instead of a traceback."""
    from reve_jax import checkpoint, sharding
    from reve_jax.train import trainer

    try:
        return trainer.run(cfg, workdir, worker, fresh=fresh)
    except (config.ConfigError, sharding.MeshError, checkpoint.CheckpointError, trainer.NonFiniteError) as e:
        logging.getLogger("reve_jax").debug("stopped by", exc_info=True)
        # A failed async save leaves Orbax's abandoned write coroutines; their warnings, collected at exit, would
        # follow (and bury) the one-line error.
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        sys.exit(f"error: {e}")
    finally:
        if worker is not None:
            worker.close()

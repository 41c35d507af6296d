"""Shared start-up for the entry scripts: logging, config errors as one clear line, the elastic worker."""

from __future__ import annotations

import logging
import os
import sys

from reve_jax import config


def setup_logging():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("absl", "orbax", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_config_or_exit(spec: str, overrides: list[str]):
    """Load and validate a config; a bad one exits with status 2 and the reason."""
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        sys.exit(f"error: unrecognised arguments {bad}; config overrides look like --config.model.depth=4")
    try:
        return config.load_config(spec, overrides)
    except config.ConfigError as e:
        sys.exit(f"config error: {e}")


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
    from reve_jax import checkpoint, sharding, trainer

    try:
        return trainer.run(cfg, workdir, worker, fresh=fresh)
    except (config.ConfigError, sharding.MeshError, checkpoint.CheckpointError, trainer.NonFiniteError) as e:
        logging.getLogger("reve_jax").debug("stopped by", exc_info=True)
        sys.exit(f"error: {e}")
    finally:
        if worker is not None:
            worker.close()

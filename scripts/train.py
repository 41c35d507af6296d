"""Train a model from a config file.

    python scripts/train.py --config configs/tiny.py --workdir runs/tiny [--config.model.depth=4 ...]

Resumes from the newest checkpoint in --workdir. Under the elastic launcher (scripts/launch.py) the REVE_*
environment variables make this process join a multi-process job.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reve_jax import cli  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config file, optionally path:arg")
    parser.add_argument("--workdir", required=True, help="run directory (checkpoints, metrics, samples)")
    args, overrides = parser.parse_known_args(argv)
    worker = cli.start_worker()
    cfg = cli.load_config_or_exit(args.config, overrides)
    summary = cli.train(cfg, args.workdir, worker)
    logging.getLogger("reve_jax").info("done: %s", summary)


if __name__ == "__main__":
    main()

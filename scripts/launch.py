"""Elastic launcher: one training process per host, kept alive through host failures.

    python scripts/launch.py --config configs/x.py --workdir runs/x --hosts 16 [--config.train.steps=...]

See reve_jax/elastic/launch.py for the options and docs/elastic.md for the design.
"""

import sys

from reve_jax.elastic.launch import main

if __name__ == "__main__":
    sys.exit(main())

"""Rebuild the checked-in evaluation feature net (the default FeatureSpec) and write its weights:

    python -m reve_jax.perceptual.build_shapes [--out reve_jax/perceptual/shapes_weights]

Deterministic for the spec on one platform (XLA's CPU and GPU kernels round differently, so a rebuild elsewhere
gives weights that differ in the last bits, and features that differ slightly). Over an hour on 2 CPU cores;
the weights are stored as float16 (about 0.5 MB), which changes features by about 1e-3 of their scale.
"""

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from reve_jax.perceptual import shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(shapes.WEIGHTS_DIR), help="directory for feature_net_<key>.npz")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    spec = shapes.DEFAULT_SPEC
    model, info = shapes.train_feature_net(spec)
    path = shapes.save_feature_net(model, info, Path(args.out) / f"feature_net_{spec.key()}.npz", np.float16)
    print(json.dumps({k: v for k, v in info.items() if k != "spec"}, indent=1))
    print(path)


if __name__ == "__main__":
    main()

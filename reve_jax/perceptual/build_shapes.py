"""Rebuild a checked-in feature net and write its weights:

    python -m reve_jax.perceptual.build_shapes [--out reve_jax/perceptual/shapes_weights]   # the metrics' (KID's)
    python -m reve_jax.perceptual.build_shapes --spec training                             # REPA's target

`default` is shapes.DEFAULT_SPEC, the metrics' network (over an hour on 2 CPU cores), stored as float16 (about
240 KB; features change by about 1e-3 of their scale). `training` is shapes.TRAINING_SPEC, the network the loss
terms read (REPA's target, trained apart from the metrics'), stored as float32 as a run that trains it on first use
caches it, so that runs on every machine align to the same target.

Deterministic for the spec on one platform (XLA's CPU and GPU kernels round differently, so a rebuild elsewhere
gives weights that differ in the last bits, and features that differ slightly).
"""

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from reve_jax.perceptual import shapes

SPECS = {"default": (shapes.DEFAULT_SPEC, np.float16), "training": (shapes.TRAINING_SPEC, np.float32)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(shapes.WEIGHTS_DIR), help="directory for feature_net_<key>.npz")
    parser.add_argument("--spec", choices=sorted(SPECS), default="default", help="which network (default: KID's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    spec, dtype = SPECS[args.spec]
    model, info = shapes.train_feature_net(spec)
    path = shapes.save_feature_net(model, info, Path(args.out) / f"feature_net_{spec.key()}.npz", dtype)
    print(json.dumps({k: v for k, v in info.items() if k != "spec"}, indent=1))
    print(path)


if __name__ == "__main__":
    main()

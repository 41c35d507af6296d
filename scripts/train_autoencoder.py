"""Train the autoencoder of a latent-space run on its data, check its reconstructions, and write its weights.

    python scripts/train_autoencoder.py --config configs/speedup/cpu.py:latent --out weights/ae_cpu.npz
    python scripts/train.py --config configs/speedup/cpu.py:latent --workdir runs/latent \
        --config.latent.path=weights/ae_cpu.npz

The config's `data` section says what to train on and its `latent` section the autoencoder's size and training
(docs/latent.md). Prints the training time and the caption alignment of the reconstructions beside the real
images'. An existing --out is never overwritten (pass --force to replace it). The training state is kept in
<out stem>.partial.npz while it runs: the same command after an interruption resumes from it.
"""

import argparse
import json
import logging
from pathlib import Path

from reve_jax import cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config file, optionally path:arg")
    parser.add_argument("--out", required=True, help="where the weights go (.npz)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--check", type=int, default=256, help="held-out images for the reconstruction check")
    args, overrides = parser.parse_known_args(argv)
    cli.setup_logging()
    cfg = cli.load_config_or_exit(args.config, overrides)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"error: {out} exists; pass --force to replace it")
    from reve_jax.latent import autoencoder
    from reve_jax.latent import training as latent_training

    partial = latent_training.partial_path(out)
    model, info = latent_training.train(cfg, partial=partial)
    info["check"] = latent_training.check_reconstructions(cfg, model, args.check)
    autoencoder.save(model, out, info)
    partial.unlink(missing_ok=True)
    logging.getLogger("reve_jax").info("wrote %s", out)
    print(json.dumps({k: info[k] for k in ("train_s", "final_mse", "check")}, indent=1))


if __name__ == "__main__":
    main()

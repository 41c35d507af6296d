"""Train a model from a config file.

    python scripts/train.py --config configs/tiny.py --workdir runs/tiny [--config.model.depth=4 ...]

Resumes from the newest checkpoint in --workdir. A workdir that holds checkpoints (or checkpoints set aside as
corrupt) never starts over at step 0 unless --fresh is given; the old checkpoints are then kept in
<workdir>/checkpoints_replaced/. Under the elastic launcher (scripts/launch.py) the REVE_* environment variables
make this process join a multi-process job (the launcher never passes --fresh).
"""

import argparse
import logging

from reve_jax import cli


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config file, optionally path:arg")
    parser.add_argument("--workdir", required=True, help="run directory (checkpoints, metrics, samples)")
    parser.add_argument("--fresh", action="store_true", help="start at step 0 even where checkpoints exist")
    parser.add_argument("--dry-run", action="store_true", help="check the config, inputs and mesh, then exit")
    args, overrides = parser.parse_known_args(argv)
    worker = cli.start_worker()
    cfg = cli.load_config_or_exit(args.config, overrides)
    if args.dry_run:
        cli.check_inputs_or_exit(cfg)
        mesh = cli.check_mesh_or_exit(cfg)
        tr = cfg.train
        cli.dry_run_exit(
            f"would train {cfg.name} for {tr.steps} steps of {tr.global_batch} images at {cfg.data.image_size} px "
            f"on mesh {cli.describe_mesh(mesh)} into {args.workdir}"
        )
    summary = cli.train(cfg, args.workdir, worker, fresh=args.fresh)
    splits = [s for s in ("unseen", "seen") if s in summary]
    logging.getLogger("reve_jax").info("done: %s", {k: v for k, v in summary.items() if k not in splits})
    for split in splits:  # the last lines: how well the final samples follow captions it never trained on
        scores = summary[split]
        line = ", ".join(f"{k[6:]} {v:.2f}" for k, v in scores.items() if k not in ("align_exact", "align_overall"))
        print(
            f"final samples, {summary['samples_scored']} {split} captions: exact {scores['align_exact']:.2f}, "
            f"overall {scores['align_overall']:.2f} ({line})",
            flush=True,
        )


if __name__ == "__main__":
    main()

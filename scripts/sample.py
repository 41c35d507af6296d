"""Render a sample grid from the newest checkpoint of a run, for prompts given on the command line.

python scripts/sample.py --workdir runs/tiny --prompt "a large red circle in the center, on a white background"
"""

import argparse
from pathlib import Path

from reve_jax import cli
from reve_jax.config import CHOICES


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a run directory with checkpoints/")
    parser.add_argument("--prompt", action="append", required=True, help="a caption (repeat for more images)")
    parser.add_argument("--out", default=None, help="PNG path (default <workdir>/samples/cli.png)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    parser.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: sample.cfg_scale)")
    parser.add_argument("--sampler", choices=CHOICES["sample.sampler"], default=None)
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--raw", action="store_true", help="use the raw parameters instead of the first EMA")
    parser.add_argument("--dry-run", action="store_true", help="check the run's config and mesh, then exit")
    args = parser.parse_args(argv)
    cli.setup_logging()
    if args.dry_run:
        step, cfg = cli.saved_config_or_exit(args.workdir)
        mesh = cli.check_mesh_or_exit(cfg)
        s = cfg.sample
        cli.dry_run_exit(
            f"would render {len(args.prompt)} images with step {step} of {args.workdir} ({cfg.name}, "
            f"{args.sampler or s.sampler} x {args.steps or s.steps} steps, mesh {cli.describe_mesh(mesh)}) "
            f"into {args.out or Path(args.workdir) / 'samples' / 'cli.png'}"
        )
    from reve_jax.train import sampling

    out = sampling.render_from_checkpoint(
        args.workdir,
        args.prompt,
        out=args.out,
        steps=args.steps,
        cfg_scale=args.cfg_scale,
        sampler=args.sampler,
        seed=args.seed,
        use_ema=not args.raw,
    )
    print(out)


if __name__ == "__main__":
    main()

"""Score a run's EMA weights: caption alignment per attribute with 95% bootstrap intervals, KID with its
real-vs-real floor, the controls, held-out v-loss; writes a JSON and a PNG grid with each caption's checks marked
(reve_jax/metrics/scoring.py, docs/evaluation.md).

python scripts/evaluate.py --workdir runs/tiny [--step N] [--n 512] [--sampler heun --steps 48 --cfg-scale 2 --t-eps 0]

The sampler, its steps, the guidance scale and the sampler's clamp are the run's unless given (the output files
then name them).
With --regions: also where the images differ from the data, the KID with each region around the objects (interior,
rim, ring, near, flat) given back its real pixels (reve_jax/metrics/regions.py; the fixed rendering only).

With --denoise T,T,...: instead, what the model returns for held-out images noised at those times (t = 1 clean)
against the noisy input itself and with another image's caption (reve_jax/metrics/denoise.py): does it use its input
or paint a template? Writes denoise_step_<N>.json and .png.
"""

import argparse

from reve_jax import cli, config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a run directory with checkpoints/")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="held-out captions to score (default 512, the final numbers; 64 with --denoise)",
    )
    parser.add_argument("--seed", type=int, default=4321, help="sampling noise seed")
    parser.add_argument("--out", default=None, help="output directory (default <workdir>/evaluation)")
    parser.add_argument("--boot", type=int, default=1000, help="bootstrap resamples for the intervals")
    parser.add_argument("--cache-dir", default=None, help="feature net cache (default ~/.cache/reve_jax)")
    parser.add_argument("--dinov2", default=None, help="converted DINOv2 weights for fd_dinov2 (optional)")
    parser.add_argument(
        "--sampler", choices=config.CHOICES["sample.sampler"], help="sample with this sampler (default: the run's)"
    )
    parser.add_argument("--steps", type=int, help="sampling steps (default: the run's sample.steps)")
    parser.add_argument("--cfg-scale", type=float, help="guidance scale (default: the run's sample.cfg_scale)")
    parser.add_argument(
        "--t-eps",
        type=float,
        help="the sampler's x-prediction clamp, sample.t_eps: 0 exact, -1 training's (default: the run's; -1 for a "
        "run saved before 2026-12-02)",
    )
    parser.add_argument(
        "--regions",
        action="store_true",
        help="also the KID with each region around the objects given back its real pixels (data.render='fixed')",
    )
    parser.add_argument(
        "--denoise", default=None, help="comma-separated times in [0, 1), e.g. 0.5,0.85,0.95,0.99: the denoising probe"
    )
    args = parser.parse_args(argv)
    cli.setup_logging()
    from reve_jax.metrics import scoring

    if args.denoise is not None:
        try:
            times = tuple(float(t) for t in args.denoise.split(","))
        except ValueError:
            parser.error(f"--denoise {args.denoise!r}: give comma-separated numbers, e.g. 0.5,0.85,0.95,0.99")
        _, json_path, png_path = scoring.denoise_checkpoint(
            args.workdir, args.step, times, args.n or 64, args.seed, args.out
        )
        print(json_path)
        print(png_path)
        return

    _, json_path, png_path = scoring.score_checkpoint(
        args.workdir,
        args.step,
        args.n or 512,
        args.seed,
        args.out,
        n_boot=args.boot,
        cache_dir=args.cache_dir,
        dinov2_path=args.dinov2,
        sample={"sampler": args.sampler, "steps": args.steps, "cfg_scale": args.cfg_scale, "t_eps": args.t_eps},
        regions=args.regions,
    )
    print(json_path)
    print(png_path)


if __name__ == "__main__":
    main()

"""The command line of the speedup benchmark (scripts/bench_speedup.py): a size file (configs/speedup/<size>.py) with
`--config.a.b=v` overrides for every run, the headline, the further methods, the sweeps and a rescore."""

import argparse
import dataclasses
import os
import platform
from pathlib import Path

from reve_jax import cli, config, xla
from reve_jax.speedup import protocol, runner, sweeps, trend

SIZES = Path(__file__).resolve().parents[2] / "configs" / "speedup"


def size_path(size: str) -> Path:
    path = Path(size) if size.endswith(".py") else SIZES / f"{size}.py"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SIZES.glob("*.py") if p.stem not in ("__init__", "shared")))
        raise SystemExit(f"error: no speedup size {size!r} ({path} does not exist); sizes: {known}")
    return path


def _grid_words(size) -> str:
    if size.sweep_around:
        return f"x2^-{size.sweep_around}..x2^{size.sweep_around} around each method's frozen rate"
    return str(list(size.sweep_lrs))


def dry_run(size, methods, extra: tuple[str, ...], args) -> None:
    """Load every run config of the command (the baseline and the methods, first seed), check its mesh and batch
    split, and exit 0."""
    if args.dinov2 and not Path(args.dinov2).is_file():
        raise SystemExit(f"error: input not found: {args.dinov2}")
    # a sweep run's config: the grid's first rate (`sweep_around`: each method's grid is centred on its frozen rate)
    lr = size.sweep_lrs[0] if args.sweep and not size.sweep_around else None
    for method in dict.fromkeys(methods if args.sweep else (size.baseline, *methods)):
        try:
            cfg = protocol.build_config(size, method, size.seeds[0], extra, lr, args.rate or "lr")
        except (config.ConfigError, ValueError) as e:
            raise SystemExit(f"config error ({method}): {e}") from None
        mesh = cli.check_mesh_or_exit(cfg)
    what = (
        f"sweep {args.rate or 'every rate'} {_grid_words(size)} and guidance {list(size.cfg_scales)} of "
        f"{', '.join(methods)} on seeds {list(size.seeds if args.seeds else size.tune_seeds)}"
        if args.sweep
        else f"train {', '.join(dict.fromkeys((size.baseline, *methods)))} on seeds {list(size.seeds)}"
    )
    where = f"on mesh {cli.describe_mesh(mesh)} into {args.out}"
    cli.dry_run_exit(f"would {what} ({size.name}, {size.steps} steps) {where}")


def main(argv=None, doc: str = __doc__):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="cpu", help="a size name: --config configs/speedup/<size>.py")
    p.add_argument("--config", help="a size file (default: the --size's); --config.a.b=v overrides every run")
    p.add_argument("--out", help="output directory (default runs/speedup_<size>)")
    p.add_argument("--methods", help="comma-separated methods, 'further' or 'ablations' (default: the headline's)")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="the LR grid and guidance scales of --methods (scored on the mean over --seeds, default the size's "
        "tuning seeds)",
    )
    p.add_argument(
        "--rate",
        default=None,
        choices=protocol.RATES,
        help="sweep one rate only: lr (the main group's) or muon_lr (Muon's, lr kept frozen); default: every rate "
        "of each method, the same way (lr, then a Muon arm's muon_lr with lr at its winner)",
    )
    p.add_argument(
        "--grid",
        help="comma-separated rates the sweep starts from (default: the size's sweep_lrs, or its sweep_around span "
        "around each method's frozen rate)",
    )
    p.add_argument("--baseline", help="time the methods against this one (default: the size's baseline)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the size's; the sweep's: its tuning seeds)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the size's)")
    p.add_argument("--evals", type=int, help="evaluations per run (default: the size's)")
    p.add_argument("--n-eval", type=int, help="held-out captions per evaluation (default: the size's)")
    p.add_argument("--quick", action="store_true", help="4 steps of batch 8, one seed: checks the code path")
    p.add_argument("--dinov2", help="converted DINOv2 .npz: adds FD-DINOv2 (scripts/convert_weights.py)")
    p.add_argument(
        "--cache-dir", help="feature-net, autoencoder and compilation cache directory (default: <out>/cache)"
    )
    p.add_argument(
        "--archive",
        help="a directory of finished runs' records kept apart from --out (e.g. committed): runs found there are "
        "reused, runs finished here are copied there (docs/speedup.md, 'Across machines')",
    )
    p.add_argument("--rescore", action="store_true", help="recompute alignment of a finished --out from its images")
    p.add_argument(
        "--trend",
        nargs="+",
        metavar="OUT",
        help="the trend with resolution: the --out directories of finished headlines at different image sizes "
        "(trend.md, trend.json and trend.png into --out, default runs/speedup_trend)",
    )
    p.add_argument("--dry-run", action="store_true", help="check the size, the run configs and the mesh, then exit")
    args, overrides = cli.parse_args(p, argv)
    if args.trend:
        out = Path(args.out or "runs/speedup_trend")
        try:
            if args.dry_run:
                cli.dry_run_exit(trend.check(args.trend, out))
            trend.write(args.trend, out)
        except trend.TrendError as e:
            raise SystemExit(f"error: {e}") from None
        print((out / "trend.md").read_text())
        print(f"wrote {out / 'trend.md'}, {out / 'trend.png'}")
        return
    args.config = args.config or str(size_path(args.size))
    args.out = args.out or f"runs/speedup_{Path(args.config).stem}"
    if args.rescore:
        if args.dry_run:
            if not Path(args.out).is_dir():
                raise SystemExit(f"error: {args.out} is not a directory: pass the --out of a finished benchmark")
            cli.dry_run_exit(f"would rescore the runs listed in {Path(args.out) / 'results.json'} from their images")
        runner.rescore(args.out)
        print((Path(args.out) / "speedup.md").read_text())
        return

    size = protocol.load_protocol(size_path(args.config))
    extra = [x.removeprefix("--config.") for x in overrides]
    if args.quick:  # the size's model and code path, a few steps of a small batch
        # An autoencoder of 4 steps reconstructs nothing: its check runs and prints, and gates nothing.
        size = dataclasses.replace(
            size, steps=4, evals=2, n_eval=8, n_final=8, seeds=size.seeds[:1], min_recon_align=0.0
        )
        extra = ["train.global_batch=8", "data.worker_threads=1", "latent.train_steps=4", *extra]
    changes = {
        "seeds": tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None,
        "steps": args.steps,
        "evals": args.evals,
        "n_eval": args.n_eval,
        "baseline": args.baseline,
        "sweep_lrs": tuple(float(x) for x in args.grid.split(",")) if args.grid else None,
        "sweep_around": 0 if args.grid else None,  # a grid given by hand replaces the span around the frozen rate
    }
    size = dataclasses.replace(size, **{k: v for k, v in changes.items() if v is not None})
    methods = None
    if args.methods:
        named = {"further": size.further, "ablations": tuple(m for m in size.further if m.startswith("recipe-"))}
        methods = named.get(args.methods) or tuple(args.methods.split(","))
    if args.dry_run:
        dry_run(size, methods or ((size.baseline, *size.methods) if args.sweep else size.methods), tuple(extra), args)
    cli.setup_logging()  # the autoencoder's and the feature net's training report their progress
    out = Path(args.out)
    xla.enable_compile_cache(Path(args.cache_dir or out / "cache") / "xla")
    print(f"machine: {platform.node()}, {xla.cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    kwargs = dict(
        extra=tuple(extra), cache_dir=args.cache_dir, archive=args.archive, log=lambda s: print(s, flush=True)
    )
    kwargs["evaluator_kwargs"] = {"dinov2_path": args.dinov2} if args.dinov2 else None
    try:
        if args.sweep:
            seeds = size.seeds if args.seeds else None  # the sweep's seeds: those given, else the tuning seeds
            names = methods or (size.baseline, *size.methods)
            if args.rate:
                result = sweeps.sweep(size, out, names, rate=args.rate, seeds=seeds, **kwargs)
            else:
                result = sweeps.sweep_all(size, out, names, seeds=seeds, **kwargs)
            frozen = {m: {k: r[k] for k in ("lr", "muon_lr", "cfg_scale") if k in r} for m, r in result.items()}
            print("freeze in the size file: FROZEN = " + repr(frozen))
            return
        runner.run_benchmark(size, out, methods=methods, **kwargs)
    except runner.RunStopped as e:
        raise SystemExit(f"stopped: {e}") from None
    except runner.RunConflict as e:
        raise SystemExit(f"error: {e}") from None
    print((out / "speedup.md").read_text())
    print(f"wrote {out / 'speedup.md'}, {out / 'speedup.png'}")

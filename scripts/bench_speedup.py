"""The speedup benchmark: the JIT-DDT recipe against a latent DiT (Linum's comparison) and the other baselines, in
steps, samples, FLOPs, wall clock and CPU seconds to reach the baseline's final caption alignment, over seeds.

    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu                 # the headline, 75 min on 2 CPUs
    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu --methods further   # baseline B, PRX, ablations
    python scripts/bench_speedup.py --size cpu --out runs/ablation_cpu --baseline recipe --methods ablations
    python scripts/bench_speedup.py --size cpu --out runs/sweep_cpu --sweep --methods latent,recipe   # LRs, guidance
    python scripts/bench_speedup.py --size cpu --out runs/sweep_cpu --sweep --methods prx --rate muon_lr   # Muon's rate
    python scripts/bench_speedup.py --size gpu --out runs/speedup_gpu                 # sized for ~8 minutes on one H200
    python scripts/bench_speedup.py --size gpu --quick --out runs/gpu_chk             # the gpu size's code path, shrunk
    python scripts/bench_speedup.py --rescore --out runs/speedup_cpu                  # alignment again from the images

A size is a config file, configs/speedup/<size>.py (or give a path). Writes <out>/speedup.md (tables with bootstrap
intervals over seeds), <out>/speedup.png (quality against wall clock and steps), <out>/results.json and one trainer
workdir and JSON per run in <out>/runs/ (a killed benchmark resumes; finished runs are reused). The sweep writes
<out>/sweep.json and says what to freeze in the size file. See reve_jax/speedup/ and docs/speedup.md.
"""

import argparse
import dataclasses
import logging
import os
import platform
from pathlib import Path

from reve_jax import cli, config, xla
from reve_jax.speedup import protocol, runner, sweeps

SIZES = Path(__file__).resolve().parents[1] / "configs" / "speedup"


def size_path(size: str) -> Path:
    path = Path(size) if size.endswith(".py") else SIZES / f"{size}.py"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SIZES.glob("*.py") if p.stem not in ("__init__", "shared")))
        raise SystemExit(f"error: no speedup size {size!r} ({path} does not exist); sizes: {known}")
    return path


def dry_run(size, methods, extra: tuple[str, ...], args) -> None:
    """Load every run config of the command (the baseline and the methods, first seed), check its mesh and batch
    split, and exit 0."""
    if args.dinov2 and not Path(args.dinov2).is_file():
        raise SystemExit(f"error: input not found: {args.dinov2}")
    lr = size.sweep_lrs[0] if args.sweep else None  # a sweep run's config: the grid's first rate
    for method in dict.fromkeys(methods if args.sweep else (size.baseline, *methods)):
        try:
            cfg = protocol.build_config(size, method, size.seeds[0], extra, lr, args.rate)
        except (config.ConfigError, ValueError) as e:
            raise SystemExit(f"config error ({method}): {e}") from None
        mesh = cli.check_mesh_or_exit(cfg)
    what = (
        f"sweep {args.rate} {list(size.sweep_lrs)} and guidance {list(size.cfg_scales)} of {', '.join(methods)} on "
        f"seeds {list(size.seeds if args.seeds else size.seeds[:1])}"
        if args.sweep
        else f"train {size.baseline} and {', '.join(methods)} on seeds {list(size.seeds)}"
    )
    where = f"on mesh {cli.describe_mesh(mesh)} into {args.out}"
    cli.dry_run_exit(f"would {what} ({size.name}, {size.steps} steps) {where}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="cpu", help="a size name (configs/speedup/<size>.py) or a size file")
    p.add_argument("--out", help="output directory (default runs/speedup_<size>)")
    p.add_argument("--methods", help="comma-separated methods, 'further' or 'ablations' (default: the headline's)")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="the LR grid and guidance scales of --methods (scored on the mean over --seeds, default one)",
    )
    p.add_argument(
        "--rate",
        default="lr",
        choices=protocol.RATES,
        help="the rate the sweep varies: lr (the main group's) or muon_lr (Muon's, lr kept frozen)",
    )
    p.add_argument("--grid", help="comma-separated rates the sweep starts from (default: the size's sweep_lrs)")
    p.add_argument("--baseline", help="time the methods against this one (default: the size's baseline)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the size's; the sweep's: the size's first)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the size's)")
    p.add_argument("--evals", type=int, help="evaluations per run (default: the size's)")
    p.add_argument("--n-eval", type=int, help="held-out captions per evaluation (default: the size's)")
    p.add_argument("--quick", action="store_true", help="4 steps of batch 8, one seed: checks the code path")
    p.add_argument("--dinov2", help="converted DINOv2 .npz: adds FD-DINOv2 (scripts/convert_weights.py)")
    p.add_argument("--cache", help="feature-net, autoencoder and compilation cache directory (default: <out>/cache)")
    p.add_argument("--config", action="append", default=[], help="extra override for every run, a.b=value")
    p.add_argument("--rescore", action="store_true", help="recompute alignment of a finished --out from its images")
    p.add_argument("--dry-run", action="store_true", help="check the size, the run configs and the mesh, then exit")
    args = p.parse_args(argv)
    args.out = args.out or f"runs/speedup_{Path(args.size).stem}"
    if args.rescore:
        if args.dry_run:
            if not Path(args.out).is_dir():
                raise SystemExit(f"error: {args.out} is not a directory: pass the --out of a finished benchmark")
            cli.dry_run_exit(f"would rescore the runs listed in {Path(args.out) / 'results.json'} from their images")
        runner.rescore(args.out)
        print((Path(args.out) / "speedup.md").read_text())
        return

    size = protocol.load_protocol(size_path(args.size))
    extra = [x.removeprefix("--").removeprefix("config.") for x in args.config]
    if args.quick:  # the size's model and code path, a few steps of a small batch
        size = dataclasses.replace(size, steps=4, evals=2, n_eval=8, n_final=8, seeds=size.seeds[:1])
        extra = ["train.global_batch=8", "data.worker_threads=1", "latent.train_steps=4", *extra]
    changes = {
        "seeds": tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None,
        "steps": args.steps,
        "evals": args.evals,
        "n_eval": args.n_eval,
        "baseline": args.baseline,
        "sweep_lrs": tuple(float(x) for x in args.grid.split(",")) if args.grid else None,
    }
    size = dataclasses.replace(size, **{k: v for k, v in changes.items() if v is not None})
    methods = None
    if args.methods:
        named = {"further": size.further, "ablations": tuple(m for m in size.further if m.startswith("recipe-"))}
        methods = named.get(args.methods) or tuple(args.methods.split(","))
    if args.dry_run:
        dry_run(size, methods or ((size.baseline, *size.methods) if args.sweep else size.methods), tuple(extra), args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    xla.enable_compile_cache(Path(args.cache or out / "cache") / "xla")
    print(f"machine: {platform.node()}, {xla.cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    kwargs = dict(extra=tuple(extra), cache_dir=args.cache, log=lambda s: print(s, flush=True))
    kwargs["evaluator_kwargs"] = {"dinov2_path": args.dinov2} if args.dinov2 else None
    try:
        if args.sweep:
            seeds = size.seeds if args.seeds else None  # the sweep's seeds: those given, else the size's first
            result = sweeps.sweep(size, out, methods or (size.baseline, *size.methods), rate=args.rate, seeds=seeds,
                                   **kwargs)  # fmt: skip
            print("freeze in the size file: FROZEN = " + repr({m: {args.rate: r[args.rate], "cfg_scale": r["cfg_scale"]}
                                                              for m, r in result.items()}))  # fmt: skip
            return
        runner.run_benchmark(size, out, methods=methods, **kwargs)
    except runner.RunStopped as e:
        raise SystemExit(f"stopped: {e}") from None
    print((out / "speedup.md").read_text())
    print(f"wrote {out / 'speedup.md'}, {out / 'speedup.png'}")


if __name__ == "__main__":
    main()

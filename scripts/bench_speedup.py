"""The speedup benchmark: the full recipe and each single technique against a DiT baseline with its own tuned,
fully decayed LR, in steps, samples, FLOPs and wall clock to first reach the baseline's final caption alignment.

    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu      # 20-30 minutes on 2 CPU cores
    python scripts/bench_speedup.py --size gpu --out runs/speedup_gpu      # sized for about 8 minutes on one H200
    python scripts/bench_speedup.py --size gpu --quick --out runs/gpu_chk  # the gpu size's code path, shrunk
    python scripts/bench_speedup.py --rescore --out runs/speedup_cpu       # alignment again, from saved images

A size is a config file, configs/speedup/<size>.py (or give a path). Writes <out>/speedup.md (tables),
<out>/speedup.png (quality against wall clock and steps), <out>/results.json and one trainer workdir and JSON per
run in <out>/runs/ (a killed benchmark resumes; finished runs are reused). See reve_jax/eval/speedup.py.
"""

import argparse
import dataclasses
import logging
import os
import platform
from pathlib import Path

from reve_jax import cli, config, xla
from reve_jax.eval import speedup

SIZES = Path(__file__).resolve().parents[1] / "configs" / "speedup"


def size_path(size: str) -> Path:
    path = Path(size) if size.endswith(".py") else SIZES / f"{size}.py"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SIZES.glob("*.py") if p.stem not in ("__init__", "shared")))
        raise SystemExit(f"error: no speedup size {size!r} ({path} does not exist); sizes: {known}")
    return path


def dry_run(size, extra: tuple[str, ...], args) -> None:
    """Load every method's run config (at the first LR and seed), check its mesh and batch split, and exit 0."""
    if args.dinov2 and not Path(args.dinov2).is_file():
        raise SystemExit(f"error: input not found: {args.dinov2}")
    for method in ("baseline", *size.methods):
        try:
            cfg = speedup.build_config(size, method, size.lrs[0], size.seeds[0], extra)
        except config.ConfigError as e:
            raise SystemExit(f"config error ({method}): {e}") from None
        mesh = cli.check_mesh_or_exit(cfg)
    runs = len(size.lrs) + len(size.seeds) * (1 + len(size.methods)) - 1
    cli.dry_run_exit(
        f"would train {runs} runs of {size.steps} steps ({size.name}: baseline at LRs {list(size.lrs)}, then "
        f"{', '.join(size.methods)} on seeds {list(size.seeds)}) on mesh {cli.describe_mesh(mesh)} into {args.out}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="cpu", help="a size name (configs/speedup/<size>.py) or a size file")
    p.add_argument("--out", help="output directory (default runs/speedup_<size>)")
    p.add_argument("--methods", help="comma-separated methods (default: the size's: recipe and each technique)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the size's)")
    p.add_argument("--lrs", help="comma-separated baseline LR sweep (default: the size's)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the size's)")
    p.add_argument("--eval-every", type=int, help="evaluation cadence in steps (default: the size's)")
    p.add_argument("--n-eval", type=int, help="held-out captions per evaluation (default: the size's)")
    p.add_argument("--quick", action="store_true", help="4 steps of batch 8, one seed, two LRs: checks the code path")
    p.add_argument("--dinov2", help="converted DINOv2 .npz: adds FD-DINOv2 (scripts/convert_weights.py)")
    p.add_argument("--cache", help="feature-net and compilation cache directory (default: <out>/cache)")
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
        speedup.rescore(args.out)
        print((Path(args.out) / "speedup.md").read_text())
        return

    size = speedup.load_protocol(size_path(args.size))
    extra = [x.removeprefix("--").removeprefix("config.") for x in args.config]
    if args.quick:  # the size's model and code path, a few steps of a small batch
        size = dataclasses.replace(size, steps=4, eval_every=2, n_eval=8, seeds=size.seeds[:1], lrs=size.lrs[:2])
        extra = ["train.global_batch=8", "data.worker_threads=1", *extra]
    changes = {
        "methods": tuple(args.methods.split(",")) if args.methods else None,
        "seeds": tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None,
        "lrs": tuple(float(x) for x in args.lrs.split(",")) if args.lrs else None,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "n_eval": args.n_eval,
    }
    size = dataclasses.replace(size, **{k: v for k, v in changes.items() if v is not None})
    if args.dry_run:
        dry_run(size, tuple(extra), args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    xla.enable_compile_cache(Path(args.cache or out / "cache") / "xla")
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", flush=True)
    results = speedup.run_benchmark(
        size,
        out,
        extra=tuple(extra),
        cache_dir=args.cache,
        dinov2_path=args.dinov2,
        log=lambda s: print(s, flush=True),
    )
    print((out / "speedup.md").read_text())
    print(f"best baseline LR {results['best_lr']:g}; wrote {out / 'speedup.md'}, {out / 'speedup.png'}")


if __name__ == "__main__":
    main()

"""The command line of scripts/plan.py: per-device memory of a config on a mesh and the cheapest change that fits."""

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv=None, doc: str = __doc__):
    """scripts/plan.py. JAX is imported only after --check-compiled has set the CPU device count."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="config file, optionally path:arg")
    parser.add_argument("--devices", type=int, required=True, help="GPUs the run uses")
    parser.add_argument("--gpu-mem-gib", type=float, default=141.0, help="memory per GPU (H200: 141)")
    parser.add_argument("--mem-fraction", type=float, default=0.9, help="share usable by XLA's allocator")
    parser.add_argument("--top", type=int, default=8, help="fitting candidates to list")
    parser.add_argument("--check-compiled", action="store_true", help="compile on emulated CPU devices too")
    parser.add_argument("--out", default="", help="write the plan and candidates to OUT/plan.json")
    parser.add_argument("--dry-run", action="store_true", help="check the config and the mesh, then exit")
    args, rest = parser.parse_known_args(argv)
    if args.check_compiled:  # before JAX starts: as many CPU devices as the mesh needs
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from reve_jax import cli, sharding
    from reve_jax.tools.plan import memory

    _, overrides = cli.parse_args(parser, argv)
    cfg = cli.load_config_or_exit(args.config, overrides)
    if args.dry_run:
        mesh = cli.check_mesh_or_exit(cfg, args.devices)
        cli.dry_run_exit(
            f"would plan {cfg.name} on {args.devices} devices as {cli.describe_mesh(mesh)} against "
            f"{args.gpu_mem_gib:g} GiB x {args.mem_fraction:g} per device"
            + (", then compile it on as many CPU devices" if args.check_compiled else "")
        )
    flash = memory.flash_for(cfg, "cpu" if args.check_compiled else "gpu")
    try:
        p, sizer = memory.plan(cfg, args.devices, args.gpu_mem_gib, args.mem_fraction, flash)
    except (sharding.MeshError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(memory.format_plan(cfg, p, flash))
    plans = memory.search(sizer, args.devices, p.budget, flash=flash)
    best = next((c for c in plans if c.fits), None)
    if not p.fits:
        if best is None:
            print("nothing fits: use more devices, a smaller global batch or a smaller model")
        else:
            size = f"{best.total / memory.GIB:.2f} GiB, cost x{best.cost:.2f}"
            print(f"would fit with: {memory.overrides_for(best)} ({size})")
    print(f"cheapest that fit on {args.devices} devices (cost: relative step time, see memory.step_cost):")
    print(memory.format_candidates(plans, args.top))
    out = {"plan": _plan_dict(p), "candidates": [_plan_dict(c) for c in plans if c.fits][: args.top]}
    if args.check_compiled:
        mesh = sharding.make_mesh(cfg.mesh)
        comp = memory.compiled_memory(cfg, mesh)
        g = memory.GIB / 1024  # MiB
        print(
            f"compiled on {mesh.size} CPU devices: arguments {comp['argument'] / g:.2f} MiB (estimate "
            f"{p.arrays / g:.2f}), arguments + temp {comp['total'] / g:.2f} MiB (estimate {p.total / g:.2f})"
        )
        out["compiled"] = comp
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan.json").write_text(json.dumps(out, indent=1))


def _plan_dict(p) -> dict:
    import dataclasses

    return dict(dataclasses.asdict(p), total=p.total, fits=p.fits)

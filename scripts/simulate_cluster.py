"""Simulate the elastic supervisor's policy on a large cluster: goodput, time lost by cause, hosts out.

    python scripts/simulate_cluster.py                        # 30 days, 1,250 hosts x 8 GPUs, isolate-and-continue
    python scripts/simulate_cluster.py --compare --compare-spares 16   # vs restart-all on the same failure trace
    python scripts/simulate_cluster.py --recommend            # sweep + refine the checkpoint interval
    python scripts/simulate_cluster.py --preset llama3        # Llama 3's setting (calibration)
    python scripts/simulate_cluster.py --before-after         # the recovery mechanisms: each alone, then all
    python scripts/simulate_cluster.py --mechanisms fast_restart,snapshots   # one run with them
    python scripts/simulate_cluster.py --hosts 512 --failures-per-gpu-day 1e-3 --ckpt-interval-s 900 --json out.json

Every field of reve_jax.tools.plan.cluster.ClusterConfig is an option (--repair-median-h, --restart-s, ...).
docs/planning.md describes the model and its calibration.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from reve_jax import cli
from reve_jax.tools.plan import cluster, interval, report, sim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=cluster.POLICIES, default=None, help="default isolate")
    parser.add_argument("--preset", choices=sorted(cluster.PRESETS), default=None)
    parser.add_argument("--compare", action="store_true", help="isolate and restart-all on one trace")
    parser.add_argument("--compare-spares", type=int, default=0, help="with --compare: also both with N spares")
    parser.add_argument("--recommend", action="store_true", help="sweep the checkpoint interval")
    parser.add_argument(
        "--mechanisms", default="", help=f"comma list of {', '.join(cluster.RECOVERY_MECHANISMS)}: applied first"
    )
    parser.add_argument("--before-after", action="store_true", help="the loss table without and with each mechanism")
    parser.add_argument("--json", default="", help="write the result(s) here")
    parser.add_argument("--dry-run", action="store_true", help="check the options, then exit")
    cluster.add_arguments(parser)
    args = parser.parse_args(argv)

    base, policy = cluster.ClusterConfig(), "isolate"
    if args.preset:
        fields, policy = cluster.PRESETS[args.preset]
        base = dataclasses.replace(base, **fields)
    policy = args.policy or policy
    mechanisms = [m for m in args.mechanisms.split(",") if m]
    c = cluster.config_from_args(args, cluster.with_mechanisms(base, mechanisms) if mechanisms else base)
    if args.dry_run:
        spares = f" (and both with {args.compare_spares} spares)" if args.compare_spares else ""
        what = f"compare isolate and restart-all{spares}" if args.compare else f"simulate policy {policy}"
        what += " without and with each recovery mechanism" if args.before_after else ""
        cli.dry_run_exit(
            f"would {what} over {c.days:g} days of {c.hosts:,} hosts x {c.gpus_per_host} GPUs"
            + (", then sweep the checkpoint interval" if args.recommend else "")
            + (f"; results to {args.json}" if args.json else "")
        )
    out = {}
    if args.before_after:
        results = interval.compare_mechanisms(c, policy)
        print(report.describe_cluster(c))
        print(report.format_comparison(results))
        print("\n" + report.format_mechanisms(results))
        out["before_after"] = {k: report.to_json(r) for k, r in results.items()}
    elif args.compare:
        results = interval.compare_policies(c, args.compare_spares)
        print(report.describe_cluster(dataclasses.replace(c, spares=0)))
        print(report.format_comparison(results))
        for name, r in results.items():
            print(f"\n[{name}]\n{report.format_result(r)}")
        out["compare"] = {k: report.to_json(r) for k, r in results.items()}
    else:
        r = sim.simulate(c, policy)
        print(report.format_result(r))
        out["result"] = report.to_json(r)
    if args.recommend:
        rec = interval.recommend(c, policy)
        print(f"\ncheckpoint interval for policy {policy}:")
        print(report.format_recommendation(rec))
        out["recommendation"] = dataclasses.asdict(rec)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()

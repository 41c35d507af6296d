"""The main of scripts/simulate_cluster.py: simulate the elastic supervisor's policy on a large cluster."""

import argparse
import dataclasses
import json
from pathlib import Path

from reve_jax import cli
from reve_jax.elastic import launch
from reve_jax.tools.plan import cluster, interval, report, sim

# The launcher's options that are policy settings of the simulated cluster too.
LAUNCHER_FIELDS = ("heartbeat_timeout", "progress_timeout", "startup_timeout", "stop_timeout", "probe_interval")


def launcher_config(base: cluster.ClusterConfig) -> cluster.ClusterConfig:
    """`base` with scripts/launch.py's default policy settings (launch.DEFAULTS)."""
    fields = {k: float(launch.DEFAULTS[k]) for k in LAUNCHER_FIELDS}
    return dataclasses.replace(base, max_strikes=int(launch.DEFAULTS["max_strikes"]), **fields)


def launcher_mtbf_guess(c: cluster.ClusterConfig) -> float:
    """The launcher's MTBF guess (launch.DEFAULTS["host_mtbf_h"]) as a multiple of the true one of `c`."""
    true_h = 24.0 / (c.failures_per_gpu_day * c.gpus_per_host) if c.failures_per_gpu_day > 0 else 1.0
    return launch.DEFAULTS["host_mtbf_h"] / true_h


def make_parser(doc: str = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=cluster.POLICIES, default=None, help="default isolate")
    p.add_argument("--preset", choices=sorted(cluster.PRESETS), default=None)
    p.add_argument("--compare", action="store_true", help="isolate and restart-all on one trace")
    p.add_argument("--compare-spares", type=int, default=0, help="with --compare: also both with N spares")
    p.add_argument("--recommend", action="store_true", help="sweep the checkpoint interval")
    p.add_argument(
        "--defaults",
        choices=("launcher", "cluster"),
        default=None,
        help="launcher (the default): scripts/launch.py's settings and recovery mechanisms; cluster: the calibration "
        "setting of docs/planning.md (the default with --preset)",
    )
    p.add_argument(
        "--mechanisms",
        default=None,
        help=f"comma list of {', '.join(cluster.RECOVERY_MECHANISMS)}, or 'none': applied first (default: the "
        f"launcher's, {','.join(launch.DEFAULT_MECHANISMS)}, with --defaults launcher; none otherwise)",
    )
    p.add_argument("--before-after", action="store_true", help="the loss table without and with each mechanism")
    p.add_argument("--json", default="", help="write the result(s) here")
    p.add_argument("--dry-run", action="store_true", help="check the options, then exit")
    cluster.add_arguments(p)
    return p


def settings(args) -> tuple[cluster.ClusterConfig, str, list[str]]:
    """The simulated cluster, the policy and the recovery mechanisms the parsed `args` ask for."""
    base, policy = cluster.ClusterConfig(), "isolate"
    if args.preset:
        fields, policy = cluster.PRESETS[args.preset]
        base = dataclasses.replace(base, **fields)
    policy = args.policy or policy
    defaults = args.defaults or ("cluster" if args.preset else "launcher")
    if defaults == "launcher":
        base = launcher_config(base)
    if args.mechanisms is None:
        mechanisms = list(launch.DEFAULT_MECHANISMS) if defaults == "launcher" else []
    else:
        mechanisms = [m for m in args.mechanisms.split(",") if m and m != "none"]
    if args.before_after:  # the table adds each mechanism to a run without any
        mechanisms = []
    c = cluster.config_from_args(args, cluster.with_mechanisms(base, mechanisms) if mechanisms else base)
    if defaults == "launcher" and args.mtbf_guess is None:
        c = dataclasses.replace(c, mtbf_guess=launcher_mtbf_guess(c))
    return c, policy, mechanisms


def main(argv=None, doc: str = __doc__):
    args = make_parser(doc).parse_args(argv)
    c, policy, mechanisms = settings(args)
    defaults = args.defaults or ("cluster" if args.preset else "launcher")
    print(f"settings: {defaults} defaults; recovery mechanisms: {', '.join(mechanisms) or 'none'}")
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

"""Simulate the elastic supervisor's policy on a large cluster: goodput, time lost by cause, hosts out.

With no flags it simulates the launcher as it runs by default (scripts/launch.py: its timeouts, the fast
restart and in-memory snapshots, re-admission by cost from its MTBF guess; reve_jax/elastic/launch.py DEFAULTS)
on 30 days of 1,250 hosts x 8 GPUs. `--defaults cluster` gives the calibration setting of docs/planning.md
instead (cluster-scale timeouts, no recovery mechanism), as `--preset` does.

    python scripts/simulate_cluster.py                        # the launcher's defaults, 10,000 GPUs, 30 days
    python scripts/simulate_cluster.py --defaults cluster     # the calibration setting (docs/planning.md)
    python scripts/simulate_cluster.py --compare --compare-spares 16   # vs restart-all on the same failure trace
    python scripts/simulate_cluster.py --recommend            # sweep + refine the checkpoint interval
    python scripts/simulate_cluster.py --preset llama3        # Llama 3's setting (calibration)
    python scripts/simulate_cluster.py --before-after         # the recovery mechanisms: each alone, then all
    python scripts/simulate_cluster.py --mechanisms none      # the launcher's timeouts, no recovery mechanism
    python scripts/simulate_cluster.py --hosts 512 --failures-per-gpu-day 1e-3 --ckpt-interval-s 900 --json out.json

Every field of reve_jax.tools.plan.cluster.ClusterConfig is an option (--repair-median-h, --restart-s, ...).
docs/planning.md describes the model and its calibration.
"""

from reve_jax.tools.plan.simulate import main, make_parser, settings  # noqa: F401 (tests load them from here)

if __name__ == "__main__":
    main(doc=__doc__)

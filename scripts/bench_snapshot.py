"""Measure what in-memory snapshots cost a training step: the real trainer on local processes (4 hosts x 2 CPU
devices by default) without faults, runs with and without snapshots interleaved (A B A B ...) so that a change of
the machine's load hits both alike, and the median step time of each.

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \\
        python scripts/bench_snapshot.py --pairs 2 --steps 30
    ... --model tiny          # configs/tiny.py as it is (width 128, depth 4, 32 px) instead of the small test model

Step times come from metrics.jsonl (`step_time`, on the train clock, which includes the snapshot hook's share on
the main thread), the first --skip steps of each run left out; the snapshot's own timings (main thread, copy to
host, write, push to the successor: medians) from process 0's log. Two estimates of the cost: between runs (median
step with snapshots / without), and within each run with snapshots (--every 2 by default): the steps that follow a
snapshot, which its thread overlaps, against the steps that do not, so that the machine's load hits both alike.
Runs stay in --workdir.
"""

import sys

from reve_jax.tools.bench.snapshots import main

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))

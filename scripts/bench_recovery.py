"""Measure recoveries of the elastic launcher: start a run, hit one host with a fault, and report the time from
the fault to training again, split as the supervisor's `recovery` record splits it (detect, kill, spawn, join,
restore, compile, first step), per run and as the median of --repeat runs per fault.

    python scripts/bench_recovery.py                                    # fake worker, local processes, SIGKILL
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \\
        python scripts/bench_recovery.py --trainer real --bed netns --fault kill,stop,partition --repeat 3
    ... --no-fast-recovery       # as before the recovery work: every process compiles, no compile-ahead or standby
    ... --trainer real --snapshot-every 1    # in-memory snapshots every step: the restore reads them (peers)

--bed local: one process per host on this machine (faults kill, stop). --bed netns: hosts are network namespaces
with their own sshd, reached over SSH (reve_jax/elastic/testbed.py; needs root; faults kill, stop, partition).
Faults: kill = SIGKILL of the victim's worker; stop = SIGSTOP (alive, silent); partition = its link down. The
victim and the step are drawn from --seed. With the fast recovery on, the fault waits until the next group size
is compiled ahead and every host has a ready standby, as it would hours into a run. Each run's events and logs
stay in <workdir>/<fault><i>/.
"""

import sys

from reve_jax.tools.bench.recovery import main

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))

"""Chaos soak of the elastic launcher: the real trainer on the namespace bed (needs root, iproute2, sshd), hit by
random faults of every kind the bed can make, then checked. docs/elastic.md ("Chaos soak") has a full run.

    sudo python scripts/chaos.py                                   # 3 hosts, 10 faults of each of the 7 kinds
    sudo python scripts/chaos.py --kinds kill,partition,supervisor --faults-per-kind 1 --steps 30 --no-settle

Faults: kill, stop (SIGSTOP), partition, sshd (down, then up), disk (one host's checkpoint directory full),
corrupt (the newest checkpoint truncated, with the copies in memory lost), supervisor (SIGTERM, then launched
again); reve_jax/elastic/chaos.py says what each does. After the soak: the run finished at its last step; every
data position was trained exactly once (each step's positions are logged by the worker); the loss of every step
is within --rtol of an uninterrupted run of the same config; no process, namespace, mount, /dev/shm file, pid
file or temporary directory of the run is left. It prints a row per fault and a table per kind (detect, training
again, steps lost), writes everything to --report, and exits 0 only when every check passed.

`scripts/chaos.py --worker ...` is the worker the launcher starts: scripts/train.py that logs each step's data.
"""

import sys

from reve_jax.elastic.chaos_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], doc=__doc__))

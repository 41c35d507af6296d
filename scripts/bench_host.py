"""Host-side costs without the model: the input pipeline's images/s, and how long a checkpoint save blocks
(plain and staged). Logic in reve_jax/tools/bench/host.py; figures in docs/data.md and docs/performance.md.

    python scripts/bench_host.py input --preset dit-b2 --batch 64 --config.data.worker_threads=2
    python scripts/bench_host.py ckpt --gb 2
"""

from reve_jax.tools.bench import host

if __name__ == "__main__":
    host.main()

"""Throughput and MFU of the train step, optionally beside the reference PyTorch DiT (logic in
reve_jax/tools/bench/throughput.py; results and method in docs/performance.md).

    python scripts/bench_throughput.py --preset dit-xl2 --batch 256 --tread both --peer
    python scripts/bench_throughput.py --preset tiny --steps 2 --config.model.dtype=float32   # CPU smoke run
"""

from reve_jax.tools.bench import throughput

if __name__ == "__main__":
    throughput.main()

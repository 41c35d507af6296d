"""DiT-XL/2's shape in pixel space (256 px, 16 px patches, width 1152, 28 blocks), batch 256.

python scripts/bench_throughput.py --preset dit-xl2 --batch 256 --tread both --peer
"""

from configs.bench import shared


def get_config():
    return shared.dit(width=1152, depth=28, heads=16)

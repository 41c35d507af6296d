"""DiT-B/2's shape in pixel space (256 px, 16 px patches, width 768, 12 blocks), batch 256.

python scripts/bench_throughput.py --preset dit-b2 --tread both
"""

from configs.bench import shared


def get_config():
    return shared.dit(width=768, depth=12, heads=12)

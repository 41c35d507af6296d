"""The 1.24B Photoroom-size model (configs/prx_1b.py) at batch 128, TREAD over blocks 2..12 of 16 as Photoroom.

python scripts/bench_throughput.py --preset prx-1b --tread both
"""

from configs import prx_1b


def get_config():
    c = prx_1b.get_config()
    c.model.route.start = 2
    c.model.route.end = -4
    c.train.global_batch = 128
    return c

"""The throughput benchmark's CPU smoke size: compiles in seconds.

python scripts/bench_throughput.py --preset tiny --steps 2
"""

from configs import tiny
from reve_jax.config import apply_override


def get_config():
    c = tiny.get_config()
    for item in (
        "model.width=32",
        "model.depth=3",
        "model.heads=2",
        "model.patch=4",
        "model.bottleneck=0",
        "model.route.start=1",
        "model.route.end=-1",
        "text.width=32",
        "text.depth=1",
        "text.heads=2",
        "text.max_len=16",
        "data.image_size=16",
        "data.max_objects=1",
        "data.worker_threads=0",
        "train.global_batch=8",
    ):
        apply_override(c, item)
    return c

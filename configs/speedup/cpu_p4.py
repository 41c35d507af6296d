"""Speedup benchmark, the CPU size outside JiT's regime: the model of configs/speedup/cpu.py on 16 px images in
4 px patches (48 values per token, far below the width), batch 16, 1,500 steps. Kept for comparison; its results
are in docs/speedup.md.

    python scripts/bench_speedup.py --size cpu_p4 --out runs/speedup_cpu_p4
"""

from configs.recipe import common
from configs.speedup import shared
from reve_jax.eval.speedup import Protocol

PROTOCOL = Protocol(name="cpu_p4", steps=1500, eval_every=150, n_eval=96, lrs=(2e-3, 4e-3, 8e-3), seeds=(0, 1))


def get_config(method=None):
    return common.method_config(
        "tiny", shared.cpu_model(image_size=16, patch=4), shared.cpu_train(PROTOCOL, batch=16), method or "recipe"
    )

"""Speedup benchmark, CPU size (about 25 minutes on 2 CPU cores): 32 px scenes in 8 px patches, so each of the 16
image tokens carries 192 values for a width-128 model (patch dimension > width, JiT's regime, as ViT/16 at 256 px);
a 3-block DiT, batch 32, 1,000 steps, evaluated 10 times on 96 held-out captions.

    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu
    python scripts/train.py --config configs/speedup/cpu.py:recipe --workdir runs/cpu_recipe   # one of its runs

`get_config(method)`: method is baseline, recipe, recipe+ddt, or techniques joined by + (configs/recipe/common.py).
"""

from configs.recipe import common
from configs.speedup import shared
from reve_jax.eval.speedup import Protocol

PROTOCOL = Protocol(name="cpu", steps=1000, eval_every=100, n_eval=96, lrs=(1e-3, 2e-3, 4e-3), seeds=(0, 1))


def get_config(method=None):
    return common.method_config(
        "tiny", shared.cpu_model(image_size=32, patch=8), shared.cpu_train(PROTOCOL, batch=32), method or "recipe"
    )

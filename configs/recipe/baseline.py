"""The DiT baseline of the speedup benchmark at a size (tiny | jit_b16 | prx_1b), optionally with single
techniques added for an ablation:

    python scripts/train.py --config configs/recipe/baseline.py:tiny --workdir runs/base_tiny
    python scripts/train.py --config configs/recipe/baseline.py:tiny,tread --workdir runs/base_tiny_tread
"""

from configs.recipe import common


def get_config(arg=None):
    return common.build(arg, default_techniques=())

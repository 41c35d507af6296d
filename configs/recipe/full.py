"""The full recipe at a size (tiny | jit_b16 | prx_1b): JiT x-prediction with v-loss, bottleneck patch
embedding, TREAD routing and Muon. Add `,ddt` for the JIT-DDT encoder-decoder:

    python scripts/train.py --config configs/recipe/full.py:tiny --workdir runs/full_tiny
    python scripts/train.py --config configs/recipe/full.py:tiny,jit,bottleneck,tread,muon,ddt --workdir runs/ddt
"""

from configs.recipe import common

RECIPE = ("jit", "bottleneck", "tread", "muon")


def get_config(arg=None):
    return common.build(arg, default_techniques=RECIPE)

"""Speedup benchmark, GPU size, sized by arithmetic for about 8 minutes on one H200 (not yet run on one): JiT's
regime at 128 px in 16 px patches (768 values per token, twice the width), 64 image tokens, scenes of up to 3
objects, an 8-block width-384 DiT, batch 128; baseline A on the 16x16x16 latents of an 8x autoencoder.

    python scripts/bench_speedup.py --size gpu --out runs/speedup_gpu
"""

from configs.recipe import common
from configs.speedup import shared
from reve_jax.speedup.runner import Protocol

# Guidance: the CPU sizes' scales (the recipe's best was 1 or 1.5 there, baseline A's 2-3) and 5, set before any run
PROTOCOL = Protocol(name="gpu", steps=2000, n_eval=512, n_final=1024, baseline="latent",
                    methods=("latent+muon", "recipe", "recipe+muon"), further=("pixel", "prx"),
                    cfg_scales=(1.0, 1.5, 2.0, 3.0, 5.0))  # fmt: skip
FROZEN = {}  # not swept yet: the config's LR (1e-3) and guidance (3) for every method

MODEL = (
    "model.width=384",
    "model.depth=8",
    "model.heads=6",
    "model.patch=16",
    "model.bottleneck=128",
    "model.dtype='bfloat16'",
    "text.width=128",
    "text.depth=2",
    "text.heads=4",
    "text.max_len=32",
    "data.image_size=128",
    "data.max_objects=3",
    "latent.downsample=8",  # baseline A's autoencoder: 16x16x16 latents
    "latent.channels=16",
)
TRAIN = (
    *shared.COMMON_TRAIN,
    "train.global_batch=128",
    "optim.lr=1e-3",
    "optim.warmup_steps=100",
    "ema.decays=(0.998,)",
    "sample.steps=20",
    "data.worker_threads=8",
)


def get_config(method=None):
    return common.method_config("tiny", MODEL, TRAIN, method or "recipe", FROZEN)

"""Speedup benchmark, the resolution trend's 64 px point: cpu30's task (4 colors, 3 shapes, one object, the jittered
rendering) and protocol at twice the resolution. The pixel models keep their token count with a larger patch (16 px
patches, 768 values per token through the rank-32 bottleneck); baseline A diffuses the 16x16x16 latents of a 4x-down
autoencoder (checked for its reconstructions before any run) in 2x2 patches, 64 tokens as at 32 px. Does the pixel
recipe's ratio over the latent baseline grow with resolution, as Linum's 3.6x at 512 px suggests? Not yet run, nor
its baseline A calibrated (whether it passes the gate in this budget and rendering).

    python scripts/bench_speedup.py --size cpu64 --out runs/speedup_cpu64                       # the 2x2 headline
    python scripts/bench_speedup.py --size cpu64 --out runs/sweep_cpu64 --sweep                 # every method's sweep

FROZEN: cpu30's rates and guidance until this size's own sweeps.
"""

import dataclasses

from configs.recipe import common
from configs.speedup import cpu, cpu30, shared

PROTOCOL = dataclasses.replace(cpu30.PROTOCOL, name="cpu64")
FROZEN = dict(cpu30.FROZEN)
# Baseline A's autoencoder at 64 px: the CPU sizes' (width 16, its training) with one level more, 4x down to 16
# channels (the same 16x16 latent grid as at 32 px), at a quarter of their rate: at their 4e-3 its training spiked
# (mse 0.02 to 0.33 near step 250) and stalled near 0.15; at width 32 it did not learn (docs/speedup_log.md,
# 2026-12-06).
AUTOENCODER = ("latent.downsample=4", "latent.channels=16", "latent.width=16", "latent.train_lr=1e-3")


def get_config(method=None):
    method = method or "recipe"
    own = (o for t in common.techniques_of(method) for o in cpu.OWN_TOKENS.get(t, ()))
    train = (*shared.cpu_train(batch=32), *own)
    model = (*shared.cpu_model(image_size=64, patch=16), *cpu30.TASK, *AUTOENCODER)
    return common.method_config("tiny", model, train, method, FROZEN)

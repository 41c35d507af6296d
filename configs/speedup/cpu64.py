"""Speedup benchmark, the resolution trend's 64 px point: cpu30's task (4 colors, 3 shapes, one object) and
protocol at twice the resolution, in the fixed rendering. The pixel models keep their token count with a larger
patch (16 px patches, 768 values per token through the rank-32 bottleneck); baseline A diffuses the 16x16x16 latents
of a 4x-down autoencoder (checked for its reconstructions before any run) in 2x2 patches, 64 tokens as at 32 px. Does
the pixel recipe's ratio over the latent baseline grow with resolution, as Linum's 3.6x at 512 px suggests?

The rendering is the issue's fallback: in cpu30's jittered rendering baseline A fails the gate at this size in the
4,500-step budget on both calibration seeds (plateaus 0.345 and 0.341; needs 0.45), and in the fixed rendering, one
image per caption, scored on the unseen compositions, it passes on both (plateaus 0.871 and 0.604;
docs/speedup_log.md, 2026-12-06). The autoencoder is the jittered rendering's (`latent.train_render`: a fixed image
is one of the jittered ones), checked again on the fixed images (0.996 on the jittered, 1.000 on the fixed). The
trend's two points therefore differ in rendering as well as resolution (docs/speedup.md, "Sizes").

    python scripts/bench_speedup.py --size cpu64 --out runs/speedup_cpu64 --archive docs/results/cpu64        # headline
    python scripts/bench_speedup.py --size cpu64 --out runs/sweep_cpu64 --sweep --archive docs/results/cpu64 # sweeps

The protocol is cpu30's (tuning seeds apart from the headline's, the per-seed gate, the plateau target, unseen
captions) with two reductions, both alike for every method, for its cost (a 64 px run costs more than a 32 px one,
and cpu30's 2x2 with its sweeps is about 60 runs): the headline is the trend's question, the recipe against baseline
A, both with AdamW (the Muon arms are further methods: `--methods latent+muon,recipe+muon` after their sweeps); each
sweep starts from its method's cpu30 rate and the rates a factor of 2 either side (`sweep_around=1`), extended like
any grid while its winner sits at an edge, with the same guidance scales.

FROZEN: baseline A's and the recipe's from their sweeps here on the tuning seeds 100 and 101 (2026-12-06/07,
docs/speedup_log.md); every other method cpu30's (not swept at this size).
"""

import dataclasses

from configs.recipe import common
from configs.speedup import cpu, cpu30, shared

PROTOCOL = dataclasses.replace(
    cpu30.PROTOCOL,
    name="cpu64",
    methods=("recipe",),  # with baseline A: the trend's pair
    further=("latent+muon", "recipe+muon", *cpu30.PROTOCOL.further),
    sweep_around=1,
    sweep_from={},  # a Muon arm's held Muon rate: set here, as a literal, when its sweep begins (cpu30.py)
)
# cpu30's vocabulary in the fixed rendering (above); the autoencoder trains on the jittered one
TASK = (*(o for o in cpu30.TASK if not o.startswith("data.render=")), "data.render='fixed'")
FROZEN = {  # each method's rates and guidance, as this size's sweeps chose them (docs/speedup_log.md, 2026-12-06/07)
    **cpu30.FROZEN,
    # baseline A on the tuning seeds 100 and 101, mean at its frozen guidance 3: 1e-3 0.857, 2e-3 0.884, 4e-3
    # 0.877, 8e-3 0.753 (extended once, to 1e-3); guidance 1 / 1.5 / 2 / 3 at 2e-3: 0.866 / 0.874 / 0.884 / 0.884
    # (2 and 3 tie: the sweep keeps the incumbent, cpu30's)
    "latent": {"lr": 2e-3, "cfg_scale": 3.0},
    # the recipe (noise scale 2.0) likewise, scored at cpu30's guidance 1.5: 2.5e-4 0.504, 5e-4 0.523, 1e-3 0.498,
    # 2e-3 0.465, 4e-3 0.452 (extended twice); guidance at 5e-4: 1 0.794, 1.5 0.523, 2 0.281, 3 0.178. Re-scored at
    # guidance 1 from the same runs (protocol item 3): 2.5e-4 0.766, 5e-4 0.794, 1e-3 0.800, 2e-3 0.756, 4e-3 0.758;
    # at 1e-3 guidance 1 again (0.800, 1.5 0.498): the choice stands (10 runs)
    "recipe": {"lr": 1e-3, "cfg_scale": 1.0},
}
# Baseline A's autoencoder at 64 px: the CPU sizes' (width 16, its training) with one level more, 4x down to 16
# channels (the same 16x16 latent grid as at 32 px), at a quarter of their rate: at their 4e-3 its training spiked
# (mse 0.02 to 0.33 near step 250) and stalled near 0.15; at width 32 it did not learn (docs/speedup_log.md,
# 2026-12-06).
AUTOENCODER = (
    "latent.downsample=4",
    "latent.channels=16",
    "latent.width=16",
    "latent.train_lr=1e-3",
    "latent.train_render='jitter'",
)


# JiT's resolution rule for pixel-space diffusion: doubling the side at a constant token count (B/16 at 256 px to
# B/32 at 512 px) doubles the noise scale (1.0 to 2.0), so that a noise level hides as much of a patch as before. This
# size doubles cpu30's side and patch, so its pixel-space methods take 2.0 (cpu30's 1.0, doubled); baseline A
# diffuses the same 16x16 latent grid at both sizes and keeps 1.0. The first two recipe runs here lacked it: an
# object on under half of the unseen captions' images (docs/results/cpu64_noise1; docs/speedup_log.md, 2026-12-06).
PIXEL_NOISE_SCALE = 2.0


def get_config(method=None):
    method = method or "recipe"
    techniques = common.techniques_of(method)
    own = (o for t in techniques for o in cpu.OWN_TOKENS.get(t, ()))
    noise = () if "latent" in techniques else (f"diffusion.noise_scale={PIXEL_NOISE_SCALE}",)
    train = (*shared.cpu_train(batch=32), *own, *noise)
    model = (*shared.cpu_model(image_size=64, patch=16), *TASK, *AUTOENCODER)
    return common.method_config("tiny", model, train, method, FROZEN)

"""Speedup benchmark, CPU size: the JIT-DDT recipe against a latent DiT (baseline A, Linum's comparison) on 32 px
scenes of one object, 3 seeds of 2,000 steps: 75 minutes on 2 CPU cores (2026-12-01), 54 with the autoencoder
cached (2026-12-02), over the 30 meant; at 1,000 steps baseline A fails the validity gate (docs/speedup.md).
The recipe works in JiT's regime: 8 px patches, 16 image tokens of 192 values for a width-128 model; baseline A
denoises the 16x16x8 latents of an autoencoder in 2x2 patches (64 tokens of 32 values), baseline B the pixels in
4 px patches (64 tokens of 48 values). 3-block DiTs, batch 32, evaluated 20 times.

    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu                       # the headline
    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu --methods further     # B, PRX, ablations
    python scripts/bench_speedup.py --size cpu --out runs/sweep_cpu --sweep --methods latent,recipe
    python scripts/train.py --config configs/speedup/cpu.py:recipe --workdir runs/cpu_recipe   # one of its runs

`get_config(method)`: a method of configs/recipe/common.py (latent, pixel, pixel_p8, recipe, prx, recipe-<t>,
prx-<t>).
FROZEN holds the LR and guidance scale per method that the sweep chose (docs/speedup.md has its table).
"""

from configs.recipe import common
from configs.speedup import shared
from reve_jax.speedup.runner import Protocol

PROTOCOL = Protocol(
    name="cpu",
    steps=2000,
    seeds=(0, 1, 2),
    baseline="latent",
    methods=("recipe",),
    further=(
        "pixel",
        "prx",
        "pixel_p8",
        "recipe-jit",
        "recipe-bottleneck",
        "recipe-ddt",
        "recipe-repa",
        "prx-tread",
        "prx-muon",
    ),  # fmt: skip
    cfg_scales=(1.0, 1.5, 2.0, 3.0),  # 1 = no guidance; from 3 up objects start to vanish at 32 px (docs/tiny.md)
)
FROZEN = {  # the sweep of 2026-12-01 (runs/sweep_cpu2; docs/speedup.md has its table)
    # Baseline A on seeds 0 and 1 (`--seeds 0,1`: seed 0 in runs/sweep_cpu2 at guidance 2, seed 1 in runs/sweep_cpu4
    # at guidance 3, 2026-12-02): 1e-3 0.495 / 0.481, 2e-3 0.818 / 0.795, 4e-3 0.824 / 0.553, 8e-3 0.837 / 0.392.
    # Seed 0 alone chose 8e-3, next to the cliff (1.6e-2: 0.404), where seed 1 stalls; the mean over both, 2e-3.
    "latent": {"lr": 2e-3, "cfg_scale": 3.0},
    "recipe": {"lr": 1e-3, "cfg_scale": 1.5},
    # the sweeps of 2026-12-02, one rate at a time: the AdamW group's with Muon's at 2e-3 (runs/sweep_cpu3: 5e-4
    # 0.764, 1e-3 0.819, 2e-3 0.788, 4e-3 0.398 at guidance 2; guidance 1 / 1.5 / 2 / 3: 0.862 / 0.865 / 0.819 /
    # 0.448), then Muon's with the AdamW group's at 1e-3 (runs/sweep_cpu4, `--rate muon_lr`: 1e-3 0.839, 2e-3
    # 0.865, 4e-3 0.857 at guidance 1.5).
    "prx": {"lr": 1e-3, "muon_lr": 2e-3, "cfg_scale": 1.5},
    # Baseline B on seed 0 (runs/sweep_cpu3, 2026-12-02, guidance 2): 5e-4 0.281, 1e-3 0.271, 2e-3 0.303, 4e-3 0.316,
    # 8e-3 0.280; guidance 1 / 1.5 / 2 / 3: 0.284 / 0.294 / 0.316 / 0.301. Its best draws backgrounds, few objects:
    # under the gate's 0.45, it does not learn in this budget (docs/speedup.md).
    "pixel": {"lr": 4e-3, "cfg_scale": 2.0},
}
# Baseline A with Muon for its 2D weights (a control, not Linum's baseline: does Muon speed the latent DiT as it does
# the pixel recipe?): baseline A's AdamW rate for the rest; Muon's from its own sweep on seeds 0 and 1
# (runs/sweep_am_cpu, 2026-12-04, `--rate muon_lr`, the grid extended twice): 4e-3 0.893, 8e-3 0.932, 1.6e-2 0.934,
# 3.2e-2 0.944, 6.4e-2 0.935 (means); guidance 1 / 1.5 / 2 / 3 at 3.2e-2: 0.923 / 0.933 / 0.937 / 0.944.
FROZEN["latent+muon"] = {**FROZEN["latent"], "muon_lr": 3.2e-2, "cfg_scale": 3.0}


# Each method at the token count where it learned best in the calibration runs: the recipe at 16 (JiT's regime of
# large patches), the baselines at 64. Baseline A reads its 16x16x8 latents in 2x2 patches (64 tokens of 32 values):
# in 4x4 patches (16 tokens, the recipe's count) it scored 0.28 against 0.38 in 2x2, in the same 1,500 steps and
# with noise-0.5 decoders (6,000 and 12,000 steps; docs/latent.md); the benchmark's costs count what its extra
# tokens cost it.
OWN_TOKENS = {"latent": ("model.patch=2",)}  # by technique: 'latent+muon' (baseline A with Muon) reads 2x2 too


def method_config(method: str, frozen: dict, data: tuple[str, ...] = ()):
    """A method's run on this size's models and batch, with `frozen`'s rates and `data` overrides (cpu30's task)."""
    own = (o for t in common.techniques_of(method) for o in OWN_TOKENS.get(t, ()))
    train = (*shared.cpu_train(batch=32), *own)
    return common.method_config("tiny", (*shared.cpu_model(image_size=32, patch=8), *data), train, method, frozen)


def get_config(method=None):
    return method_config(method or "recipe", FROZEN)

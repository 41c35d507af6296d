"""Speedup benchmark, the CPU size calibrated for a 30-minute headline: the `cpu` size's models, batch and methods on
a smaller vocabulary (4 colors, 3 shapes, one object on 32 px), where baseline A learns in 1,000 steps (on the full
vocabulary it needs 1,500-2,000: at 1,000 it failed the validity gate on seed 1 at every LR, docs/speedup.md).
10 evaluations of 128 held-out captions, the final one on 256; its own autoencoder (the `cpu` size's settings,
trained once on this data and cached).

    python scripts/bench_speedup.py --size cpu30 --out runs/speedup_cpu30                       # the headline
    python scripts/bench_speedup.py --size cpu30 --out runs/sweep_cpu30 --sweep --methods latent --seeds 0,1

`get_config(method)`: a method of configs/recipe/common.py, as in configs/speedup/cpu.py.
FROZEN: baseline A's, baseline B's, the recipe's and the PRX variant's rates and guidance from this size's own sweeps
(docs/speedup.md; baseline B's confirmed the `cpu` size's values); an ablation takes its method's (`recipe-<t>` the
recipe's, `prx-<t>` the PRX variant's), the other further methods the `cpu` size's, not swept on this data.
"""

from configs.speedup import cpu
from reve_jax.speedup.runner import Protocol

PROTOCOL = Protocol(
    name="cpu30",
    steps=1000,
    seeds=(0, 1, 2),
    evals=10,
    n_eval=128,
    n_final=256,
    baseline="latent",
    methods=("recipe",),
    further=cpu.PROTOCOL.further,
    cfg_scales=cpu.PROTOCOL.cfg_scales,
)
# The vocabulary: the palette's most distinct colors (backgrounds and objects) and the three shapes of distinct
# symmetry (the reader's least confusable).
TASK = ("data.colors=('red','green','blue','white')", "data.shapes=('circle','square','triangle')")
FROZEN = {
    **cpu.FROZEN,
    # the sweeps of 2026-12-03 (runs/probe30; final alignment on 128 captions, mean over the seeds): baseline A on
    # seeds 0 and 1: 1e-3 0.484 / 0.569, 2e-3 0.620 / 0.599, 4e-3 0.650 / 0.527 (means 0.527, 0.609, 0.589);
    # guidance 1 / 1.5 / 2 / 3 at 2e-3: 0.576 / 0.605 / 0.618 / 0.609. The recipe on seed 0: 5e-4 0.365, 1e-3
    # 0.757, 2e-3 0.617; guidance at 1e-3: 0.712 / 0.757 / 0.684 / 0.436. Again on seeds 0 and 1 (runs/sweep_r30,
    # 2026-12-04): 5e-4 0.365 / 0.301, 1e-3 0.757 / 0.542, 2e-3 0.617 / 0.440 (means 0.333, 0.649, 0.529); guidance
    # 1 / 1.5 / 2 / 3 at 1e-3: 0.595 / 0.649 / 0.618 / 0.456.
    "latent": {"lr": 2e-3, "cfg_scale": 2.0},
    "recipe": {"lr": 1e-3, "cfg_scale": 1.5},
    # baseline B on seeds 0 and 1 (runs/sweep_b30, 2026-12-03): 2e-3 0.370 / 0.289, 4e-3 0.466 / 0.262, 8e-3 0.271 /
    # 0.264 (means 0.329, 0.364, 0.268); guidance 1 / 1.5 / 2 / 3 at 4e-3: 0.341 / 0.363 / 0.364 / 0.357.
    "pixel": {"lr": 4e-3, "cfg_scale": 2.0},
    # the PRX variant on seeds 0 and 1 (2026-12-04), one rate at a time as on the `cpu` size: the AdamW group's with
    # Muon's at 2e-3 (runs/sweep_prx30: 5e-4 0.843, 1e-3 0.845, 2e-3 0.795), then Muon's with the AdamW group's at
    # 1e-3 (runs/sweep_muon30, `--rate muon_lr`: 1e-3 0.661, 2e-3 0.845, 4e-3 0.870, 8e-3 0.900, 1.6e-2 0.887);
    # guidance 1 / 1.5 / 2 / 3 at the winner: 0.892 / 0.900 / 0.754 / 0.298. Its ablations without TREAD or Muon
    # take these rates (Muon's unused without Muon).
    "prx": {"lr": 1e-3, "muon_lr": 8e-3, "cfg_scale": 1.5},
    # baseline A with Muon for its 2D weights (a control, not Linum's baseline: does Muon speed the latent DiT as it
    # does the pixel recipe?): baseline A's AdamW rate; Muon's from its own sweep on seeds 0 and 1 (runs/sweep_am30,
    # 2026-12-04, `--rate muon_lr`): 2e-3 0.624, 4e-3 0.813, 8e-3 0.861, 1.6e-2 0.936, 3.2e-2 0.890; guidance 1 /
    # 1.5 / 2 / 3 at 1.6e-2: 0.918 / 0.926 / 0.936 / 0.939.
}
FROZEN["latent+muon"] = {**FROZEN["latent"], "muon_lr": 1.6e-2, "cfg_scale": 3.0}


def get_config(method=None):
    return cpu.method_config(method or "recipe", FROZEN, TASK)

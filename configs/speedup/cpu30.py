"""Speedup benchmark, the small CPU size: the `cpu` size's models, batch and methods on a smaller vocabulary (4
colors, 3 shapes, one object on 32 px) in the jittered rendering (each caption a distribution of images); its own
autoencoder, the `cpu` size's settings, trained once on this data and cached (1,176 s on 2 cores, reconstructions
0.984). Scored on the unseen compositions (never in the training stream).

The data and the budget come from baseline A on the calibration seeds 102 and 103 (neither a tuning nor a headline
seed; its frozen rate below): in the jittered rendering a 3,000-step run passes the gate on both (plateau 0.794 and
0.730), so the size uses it, as issue 45 asks wherever baseline A can. That run's flat end was the cosine decay, not
a plateau: 4,500 steps end at 0.845 and 0.808, 6,750 steps at 0.859 on seed 102 (docs/speedup_log.md, 2026-12-05),
so the budget is 4,500 steps, 15 evaluations of 128 captions, the final one on 256. A run takes about 17 minutes on
2 cores, so the 2x2 on 5 seeds is about 6 hours and each method's sweep at least 8 runs (16 for a Muon arm): no
longer the 30 minutes the name recalls.

    python scripts/bench_speedup.py --size cpu30 --out runs/speedup_cpu30 --archive docs/results/cpu30   # headline
    python scripts/bench_speedup.py --size cpu30 --out runs/sweep30 --sweep --archive docs/results/cpu30  # sweeps

`get_config(method)`: a method of configs/recipe/common.py, as in configs/speedup/cpu.py.
FROZEN: the 2x2's rates and guidance from their sweeps at this budget on the tuning seeds 100 and 101 (2026-12-06,
docs/speedup_log.md): baseline A 10 runs, the recipe 8, the recipe with Muon 20 and baseline A with Muon 24 (two of
each Muon arm's reused from its AdamW group's sweep). An ablation takes its method's (`recipe-<t>` the recipe's,
`prx-<t>` the PRX variant's), the other further methods the `cpu` size's.
"""

from configs.speedup import cpu
from reve_jax.speedup.runner import Protocol

PROTOCOL = Protocol(
    name="cpu30",
    steps=4500,  # baseline A's plateau: 6,750 steps end no higher (jittered rendering, calibration seed 102)
    evals=15,
    n_eval=128,
    n_final=256,
    baseline="latent",
    methods=("latent+muon", "recipe", "recipe+muon"),  # with baseline A: the 2x2
    further=cpu.PROTOCOL.further,
    cfg_scales=cpu.PROTOCOL.cfg_scales,
    # Muon's rate during each Muon arm's AdamW sweep: the values frozen when the sweeps began (the first protocol's)
    sweep_from={"latent+muon": {"muon_lr": 1.6e-2}, "recipe+muon": {"muon_lr": 8e-3}},
)
# The vocabulary: the palette's most distinct colors (backgrounds and objects) and the three shapes of distinct
# symmetry (the reader's least confusable); the jittered rendering, where baseline A passes the gate in the budget
# (a distribution of images per caption: with one image each the ideal denoiser is a lookup).
TASK = (
    "data.colors=('red','green','blue','white')",
    "data.shapes=('circle','square','triangle')",
    "data.render='jitter'",
)
FROZEN = {  # each method's rates and guidance, as this size's sweeps chose them (docs/speedup_log.md)
    **cpu.FROZEN,
    # the tuning sweeps at this budget (their tables: docs/speedup_log.md, 2026-12-06; rebuilt from the archive
    # without training by `--sweep --methods latent,recipe --archive docs/results/cpu30`)
    "latent": {"lr": 4e-3, "cfg_scale": 3.0},
    "recipe": {"lr": 2e-3, "cfg_scale": 1.5},
    "pixel": {"lr": 4e-3, "cfg_scale": 2.0},  # the `cpu` size's values, confirmed by its own sweep (under the gate)
    # one rate at a time as on the `cpu` size; Muon's rate, 4x the `cpu` size's, is the best inside an extended grid.
    # Its ablations without TREAD or Muon take these rates (Muon's unused without Muon).
    "prx": {"lr": 1e-3, "muon_lr": 8e-3, "cfg_scale": 1.5},
}
# baseline A with Muon for its 2D weights: its AdamW group's grid (Muon held at 1.6e-2, the first protocol's), then
# Muon's group's (AdamW pinned at the winner, extended once to 3.2e-2), both winners inside their grids (24 runs, 22
# trained); guidance 3 stays. Its Muon grid dips at 8e-3 (0.666 between 0.826 and 0.865): seed noise of this size
FROZEN["latent+muon"] = {"lr": 4e-3, "muon_lr": 1.6e-2, "cfg_scale": 3.0}
# the recipe with Muon: its AdamW group's grid (Muon held at the PRX variant's 8e-3), then Muon's group's (AdamW
# pinned at the winner), both winners inside their grids, rescored at the guidance the first pass chose (2): Muon's
# winner is the rate the AdamW sweep held, by 0.001 over 4e-3
FROZEN["recipe+muon"] = {"lr": 1e-3, "muon_lr": 8e-3, "cfg_scale": 2.0}


def get_config(method=None):
    return cpu.method_config(method or "recipe", FROZEN, TASK)

"""Speedup benchmark, the CPU size calibrated for a 30-minute headline: the `cpu` size's models, batch and methods on
a smaller vocabulary (4 colors, 3 shapes, one object on 32 px), where baseline A learns in 1,000 steps (on the full
vocabulary it needs 1,500-2,000: at 1,000 it failed the validity gate on seed 1 at every LR, docs/speedup_log.md).
10 evaluations of 128 held-out captions, the final one on 256; its own autoencoder (the `cpu` size's settings,
trained once on this data and cached).

    python scripts/bench_speedup.py --size cpu30 --out runs/speedup_cpu30                       # the headline
    python scripts/bench_speedup.py --size cpu30 --out runs/sweep_cpu30 --sweep --methods latent --seeds 0,1

`get_config(method)`: a method of configs/recipe/common.py, as in configs/speedup/cpu.py.
FROZEN: baseline A's, baseline B's, the recipe's and the PRX variant's rates and guidance from this size's own sweeps
(docs/speedup_log.md; baseline B's confirmed the `cpu` size's values); an ablation takes its method's (`recipe-<t>` the
recipe's, `prx-<t>` the PRX variant's), the other further methods the `cpu` size's, not swept on this data.
"""

from configs.speedup import cpu
from reve_jax.speedup.runner import Protocol

PROTOCOL = Protocol(
    name="cpu30",
    steps=1000,
    evals=10,
    n_eval=128,
    n_final=256,
    baseline="latent",
    methods=("latent+muon", "recipe", "recipe+muon"),  # with baseline A: the 2x2
    further=cpu.PROTOCOL.further,
    cfg_scales=cpu.PROTOCOL.cfg_scales,
)
# The vocabulary: the palette's most distinct colors (backgrounds and objects) and the three shapes of distinct
# symmetry (the reader's least confusable).
TASK = ("data.colors=('red','green','blue','white')", "data.shapes=('circle','square','triangle')")
FROZEN = {  # each method's rates and guidance, as this size's sweeps chose them (docs/speedup_log.md)
    **cpu.FROZEN,
    # the best mean over seeds 0 and 1, at the `cpu` size's rate; guidance 2 edges out 3 on this vocabulary
    "latent": {"lr": 2e-3, "cfg_scale": 2.0},
    "recipe": {"lr": 1e-3, "cfg_scale": 1.5},  # the best mean over seeds 0 and 1, the `cpu` size's values
    "pixel": {"lr": 4e-3, "cfg_scale": 2.0},  # the `cpu` size's values, confirmed by its own sweep (under the gate)
    # one rate at a time as on the `cpu` size; Muon's rate, 4x the `cpu` size's, is the best inside an extended grid.
    # Its ablations without TREAD or Muon take these rates (Muon's unused without Muon).
    "prx": {"lr": 1e-3, "muon_lr": 8e-3, "cfg_scale": 1.5},
}
# baseline A with Muon for its 2D weights (a control, as on the `cpu` size): Muon's rate from its own sweep
FROZEN["latent+muon"] = {**FROZEN["latent"], "muon_lr": 1.6e-2, "cfg_scale": 3.0}
FROZEN["recipe+muon"] = dict(FROZEN["prx"])  # the PRX variant's rates (the same groups) until its own sweep


def get_config(method=None):
    return cpu.method_config(method or "recipe", FROZEN, TASK)

"""Planning past one machine: what a run costs before it runs.

- `cluster`: the simulated cluster's parameters (failure rates, repair, checkpoint and restart costs) and its
  failure trace, drawn once per seed.
- `sim`: a discrete-event simulation that drives the elastic supervisor's real policy
  (`reve_jax.elastic.policy`) against that trace and accounts every GPU-second (goodput and losses by cause).
- `interval`: the checkpoint interval that maximises goodput (sweep and refine) beside Young's and Daly's
  formulas, and isolate-and-continue against restart-all on one trace.
- `memory`: per-device bytes of parameters, optimizer state, EMA and activations for a config on a mesh, and the
  cheapest sharding / remat / accumulation that fits a GPU.

docs/planning.md explains the models, their calibration and their limits.
"""

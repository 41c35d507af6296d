"""The speedup benchmark: the JIT-DDT recipe against a latent DiT (Linum's comparison) and the other baselines, in
steps, samples, executed FLOPs, wall clock and CPU seconds to reach the baseline's final quality (docs/speedup.md).

A size is a config file (configs/speedup/<size>.py) holding its PROTOCOL, the LR and guidance scale frozen per
method by the sweep (FROZEN), and `get_config(method)`. The protocol:

- every method trains the same budget (steps of the same batch) with a cosine LR decayed to 0, on >= 3 seeds; a
  seed sets the model's initialisation, the noise and the data (data.seed), and methods are paired within a seed;
- each run is a trainer run (`trainer.run`) with the evaluation hook (metrics/hook.py) in its own workdir under
  `<out>/runs/<key>/`: it checkpoints at every evaluation, so a killed benchmark resumes; its EMA weights are
  evaluated every `steps / evals` steps on `n_eval` held-out captions (fixed noise, sampler and guidance) and at
  the end on `n_final`; the train clock excludes compilation, evaluation and checkpoint writes;
- time to target (speedup/target.py): the first crossing of the seed's baseline final value, interpolated between
  evaluations and sustained over two; censored at the budget (">"); the baseline's time is its full budget;
- a latent baseline's autoencoder is trained once per size (cached; its cost reported apart) and its
  reconstructions must score >= `min_recon_align` caption alignment before any run starts;
- the validity gate: a baseline whose final alignment is below `gate_final`, or that gained less than
  `gate_gain` over its first evaluation, gives "no speedup measurable" instead of ratios.

`sweep` runs the LR grid (and then the guidance scales) of each method on the first seed and says what to freeze;
`run_benchmark` runs the comparison. Finished runs are stored as JSON under `<out>/runs/` and reused.
"""

"""The speedup benchmark: the JIT-DDT recipe against a latent DiT (Linum's comparison) and the other baselines, in
steps, samples, executed FLOPs, wall clock and CPU seconds to reach the baseline's plateau (docs/speedup.md).

A size is a config file (configs/speedup/<size>.py) holding its PROTOCOL, the LR and guidance scale frozen per
method by the sweeps (FROZEN), and `get_config(method)`. The protocol, in short:

- the headline is a 2x2, {latent DiT, JIT-DDT recipe} x {AdamW, Muon}, on >= 5 fresh seeds; every method trains
  the same budget with a cosine LR decayed to 0; a seed sets the initialisation, the noise and the data, and
  methods are paired within a seed (runner.py);
- the sweeps (sweeps.py) run on the size's tuning seeds with their own evaluation noise, the same grid and
  guidance scales for every method and each rate of a Muon arm; nothing chosen on a seed is reported on it;
- every evaluation scores the EMA weights on captions of unseen compositions (never in the training stream);
- the target is each seed's baseline plateau (the mean of its last evaluations); every method, the baseline too,
  is timed by one crossing rule (target.py); a run that never reaches it, or diverges, is censored at the budget;
- the gate is per seed; fewer than 3 passing seeds give "no speedup measurable"; intervals resample seeds and
  captions from 5 seeds, else the report prints the range (analysis.py);
- one-time costs (the autoencoder, REPA's target network) in their own table, and wall clock only between runs
  of one invocation (report.py); the ratio against resolution across sizes (trend.py).
"""

"""The speedup benchmark: the JIT-DDT recipe against a latent DiT (Linum's comparison) and the other baselines, in
steps, samples, FLOPs, wall clock and CPU seconds to reach the baseline's final caption alignment, over seeds.

    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu                 # the headline
    python scripts/bench_speedup.py --size cpu --out runs/speedup_cpu --methods further   # baseline B, PRX, ablations
    python scripts/bench_speedup.py --size cpu --out runs/ablation_cpu --baseline recipe --methods ablations
    python scripts/bench_speedup.py --size cpu --out runs/sweep_cpu --sweep --methods latent,recipe   # LRs, guidance
    python scripts/bench_speedup.py --size cpu --out runs/sweep_cpu --sweep --methods prx --rate muon_lr   # Muon's rate
    python scripts/bench_speedup.py --size gpu --out runs/speedup_gpu                 # sized for ~8 minutes on one H200
    python scripts/bench_speedup.py --size gpu --quick --out runs/gpu_chk             # the gpu size's code path, shrunk
    python scripts/bench_speedup.py --rescore --out runs/speedup_cpu                  # alignment again from the images
    python scripts/bench_speedup.py --trend runs/speedup_cpu30 runs/speedup_cpu64     # the ratio against resolution

A size is a config file, configs/speedup/<size>.py (or give a path). Writes <out>/speedup.md (tables with bootstrap
intervals over seeds), <out>/speedup.png (quality against wall clock and steps), <out>/results.json and one trainer
workdir and JSON per run in <out>/runs/ (a killed benchmark resumes; finished runs are reused). The sweep writes
<out>/sweep.json, <out>/sweep.md (every sweep run in one table) and says what to freeze in the size file.
Overrides for every run: --config.a.b=v. See reve_jax/speedup/ and docs/speedup.md.
"""

from reve_jax.speedup.cli import main

if __name__ == "__main__":
    main(doc=__doc__)

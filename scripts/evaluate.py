"""Score a run's EMA weights: caption alignment per attribute with 95% bootstrap intervals, KID with its
real-vs-real floor, the controls, held-out v-loss; writes a JSON and a PNG grid with each caption's checks marked
(reve_jax/metrics/scoring.py, docs/evaluation.md).

python scripts/evaluate.py --workdir runs/tiny [--step N] [--n 512] [--sampler heun --steps 48 --cfg-scale 2 --t-eps 0]

The sampler, its steps, the guidance scale and the sampler's clamp are the run's unless given (the output files
then name them).
With --regions: also where the images differ from the data, the KID with each region around the objects (interior,
rim, ring, near, flat) given back its real pixels (reve_jax/metrics/regions.py; the fixed rendering only).

With --denoise T,T,...: instead, what the model returns for held-out images noised at those times (t = 1 clean)
against the noisy input itself and with another image's caption (reve_jax/metrics/denoise.py): does it use its input
or paint a template? Writes denoise_step_<N>.json and .png.
"""

from reve_jax.metrics.scoring import main

if __name__ == "__main__":
    main(doc=__doc__)

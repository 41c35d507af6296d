"""Time to target: interpolation, sustain, censoring, paired speedups with bootstrap intervals, the validity gate;
against hand-computed curves."""

import math

import numpy as np
import pytest

from reve_jax.speedup import target


def _curve(values, step_s=1.0, every=100, batch=8, img_flops=1e9, metric="align_overall"):
    return [
        {"step": every * (i + 1), "samples": every * (i + 1) * batch, "flops": every * (i + 1) * batch * img_flops,
         "wall_s": every * (i + 1) * step_s, "cpu_s": 2 * every * (i + 1) * step_s, metric: v}
        for i, v in enumerate(values)
    ]  # fmt: skip


def test_crossing_interpolates_and_needs_two_evaluations():
    c = _curve([0.1, 0.3, 0.7, 0.8])
    hit = target.crossing(c, "align_overall", 0.5)
    assert hit["step"] == pytest.approx(250) and hit["wall_s"] == pytest.approx(250)
    assert hit["samples"] == pytest.approx(2000) and hit["cpu_s"] == pytest.approx(500)
    # A lucky evaluation that the next does not confirm is not a crossing; the last evaluation counts alone.
    assert target.crossing(_curve([0.1, 0.6, 0.3, 0.4]), "align_overall", 0.5) is None
    assert target.crossing(_curve([0.1, 0.6, 0.3, 0.6]), "align_overall", 0.5)["step"] == pytest.approx(366.67, 1e-3)
    assert target.crossing(_curve([0.6, 0.7]), "align_overall", 0.5)["step"] == 100  # the first evaluation
    assert target.crossing(_curve([0.1, float("nan"), 0.6, 0.7]), "align_overall", 0.5)["step"] == 300
    # Lower is better.
    low = _curve([9.0, 5.0, 2.0, 1.0], metric="kid")
    assert target.crossing(low, "kid", 3.0, higher=False)["step"] == pytest.approx(200 + 100 * 2 / 3)


def test_paired_speedups_censoring_and_bootstrap():
    runs = []
    for seed, (b, r, slow) in enumerate(
        [
            ([0.2, 0.4, 0.5, 0.6], [0.5, 0.7, 0.8, 0.9], [0.1, 0.2, 0.3, 0.4]),
            ([0.2, 0.3, 0.4, 0.5], [0.4, 0.6, 0.7, 0.8], [0.1, 0.2, 0.6, 0.6]),
            ([0.3, 0.4, 0.6, 0.7], [0.5, 0.8, 0.8, 0.9], [0.1, 0.1, 0.2, 0.2]),
        ]
    ):
        runs += [{"method": "base", "seed": seed, "curve": _curve(b)},
                 {"method": "fast", "seed": seed, "curve": _curve(r, step_s=2.0)},
                 {"method": "slow", "seed": seed, "curve": _curve(slow)}]  # fmt: skip
    s = target.paired(runs, "base")
    assert s["base"]["reached"] == 3 and s["base"]["speedup"]["step"][0] == pytest.approx(1.0)
    # fast: seed 0 target 0.6, crossing between 0.5@100 and 0.7@200 -> 150; seed 1 target 0.5 -> 150; seed 2
    # target 0.7 -> 100 + 100 * 0.2/0.3.
    steps = [p["cost"]["step"] for p in s["fast"]["per_seed"]]
    np.testing.assert_allclose(steps, [150, 150, 100 + 100 * 2 / 3])
    ratios = [400 / x for x in steps]
    assert s["fast"]["speedup"]["step"][0] == pytest.approx(math.exp(np.mean(np.log(ratios))))
    assert s["fast"]["speedup"]["wall_s"][0] == pytest.approx(s["fast"]["speedup"]["step"][0] / 2)  # 2x slower steps
    lo, hi = s["fast"]["speedup"]["step"][1:]
    assert min(ratios) - 1e-9 <= lo <= s["fast"]["speedup"]["step"][0] <= hi <= max(ratios) + 1e-9
    # slow: seed 0 never reaches 0.6 (censored at its budget: ratio 1), seed 1 reaches 0.5 at 300 and holds.
    assert s["slow"]["reached"] == 1 and s["slow"]["censored"]
    assert [p["reached"] for p in s["slow"]["per_seed"]] == [False, True, False]


def test_gate_refuses_a_baseline_that_did_not_learn():
    good = [{"method": "base", "seed": 0, "curve": _curve([0.1, 0.3, 0.5])}]
    assert target.gate(good, "base")[0]
    low = [{"method": "base", "seed": 0, "curve": _curve([0.1, 0.3, 0.4])}]
    ok, why = target.gate(low, "base")
    assert not ok and why.startswith("no speedup measurable") and "0.400" in why
    flat = [{"method": "base", "seed": 0, "curve": _curve([0.4, 0.45, 0.5])}]
    assert not target.gate(flat, "base")[0]  # gained 0.1 < 0.2


def test_bootstrap_interval_contains_the_statistic_and_narrows_with_agreement():
    m, lo, hi = target.bootstrap([1.0, 2.0, 3.0, 4.0])
    assert lo <= m <= hi and m == 2.5
    m, lo, hi = target.bootstrap([2.0, 2.0, 2.0])
    assert lo == hi == m == 2.0


def test_bootstrap_draws_the_resamples_of_a_loop_one_at_a_time():
    """The vectorized resampling against the plain loop over resamples: the same interval to the last bit, for the
    mean and the geometric mean (the speedups' statistic)."""
    import numpy as np

    v = np.array([1.3, 0.8, 2.1, 1.7, 0.95])
    for stat, ref in ((np.mean, np.mean), (target.geomean, lambda x: np.exp(np.log(x).mean()))):
        rng = np.random.default_rng(3)
        draws = [ref(v[rng.integers(0, len(v), len(v))]) for _ in range(2000)]
        want = (ref(v), *np.percentile(draws, [2.5, 97.5]))
        assert target.bootstrap(list(v), stat=stat, n=2000, seed=3) == tuple(float(x) for x in want)

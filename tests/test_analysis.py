"""The headline's statistics (speedup/analysis.py) on hand-made curves, each against a value worked out by hand."""

import math

import numpy as np
import pytest

from reve_jax.data.synthetic import alignment
from reve_jax.speedup import analysis

GATE = dict(gate_final=0.45, gate_gain=0.2)


def _curve(values, every=100, sec_per_step=0.5):
    return [{"step": (i + 1) * every, "samples": (i + 1) * every * 32, "flops": (i + 1) * every * 1e9,
             "wall_s": (i + 1) * every * sec_per_step, "cpu_s": (i + 1) * every * 2 * sec_per_step,
             "align_overall": v} for i, v in enumerate(values)]  # fmt: skip


BASE = [0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8]  # plateau 0.8, first reached at step 600


def test_the_baseline_is_timed_by_the_same_rule_against_its_plateau_and_a_method_twice_as_fast_reads_2x():
    fast = [0.5, 0.7, 0.8, 0.85, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]  # reaches 0.8 at step 300 and holds it
    runs = [{"method": m, "seed": s, "curve": _curve(c)} for s in range(3) for m, c in (("base", BASE), ("x", fast))]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE)
    assert res["ok"] and [g["plateau"] for g in res["gate"]] == pytest.approx([0.8] * 3)
    row = res["methods"]["x"]
    # baseline: 600 steps to its plateau (not its full budget of 1000); x: 300 steps -> 2x in every cost
    assert row["speedup"]["step"] == pytest.approx((2.0, 2.0, 2.0))
    assert row["speedup"]["wall_s"][0] == pytest.approx(2.0) and row["interval"] == "range"
    assert res["methods"]["base"]["speedup"]["step"][0] == pytest.approx(1.0)


def test_a_crossing_between_evaluations_is_interpolated():
    # x crosses 0.8 halfway between steps 200 (0.7) and 300 (0.9): 250 steps; the baseline needs 600: 2.4x
    x = [0.5, 0.7, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    runs = [{"method": m, "seed": s, "curve": _curve(c)} for s in range(3) for m, c in (("base", BASE), ("x", x))]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE)
    assert res["methods"]["x"]["speedup"]["step"][0] == pytest.approx(600 / 250)


def test_a_run_that_never_reaches_or_diverges_is_censored_at_the_full_budget():
    slow = [0.1] * 10
    cut = [0.3, 0.5]  # diverged after step 200: censored at 1000 steps, not at 200
    runs = [{"method": "base", "seed": s, "curve": _curve(BASE)} for s in range(3)]
    runs += [{"method": "slow", "seed": s, "curve": _curve(slow)} for s in range(3)]
    runs += [{"method": "cut", "seed": s, "curve": _curve(cut)} for s in range(3)]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE)
    for m in ("slow", "cut"):
        row = res["methods"][m]
        assert row["reached"] == 0 and row["upper_bound"]
        assert row["speedup"]["step"][0] == pytest.approx(600 / 1000)
        assert row["speedup"]["wall_s"][0] == pytest.approx(300 / 500)  # the cut run's wall clock scaled to 1000


def test_the_gate_is_per_seed_and_three_passing_seeds_are_needed():
    flat = [0.3, 0.32, 0.33, 0.33, 0.33, 0.33, 0.33, 0.33, 0.33, 0.33]  # plateau under 0.45: this seed fails
    runs = [{"method": "base", "seed": s, "curve": _curve(BASE if s != 1 else flat)} for s in range(4)]
    runs += [{"method": "x", "seed": s, "curve": _curve(BASE)} for s in range(4)]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE)
    assert [g["ok"] for g in res["gate"]] == [True, False, True, True] and res["ok"]
    assert [p["seed"] for p in res["methods"]["x"]["per_seed"]] == [0, 2, 3]
    # The mean over seeds passes the old gate ((3 x 0.8 + 0.33) / 4 = 0.68), yet only two seeds pass here.
    res = analysis.analyze([r for r in runs if r["seed"] != 3], "base", "align_overall", 1000, **GATE)
    assert not res["ok"] and "no speedup measurable" in res["why"] and not res["methods"]


def test_the_gate_prints_how_far_the_plateau_still_rises_and_does_not_gate_on_it():
    climbing = [0.2, 0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75]  # +0.05 an evaluation: +0.15 over three
    runs = [{"method": "base", "seed": s, "curve": _curve(BASE if s else climbing)} for s in range(3)]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE)
    rises = [g["rise"] for g in res["gate"]]
    # BASE's last six: 0.7, 0.8, 0.8 | 0.8, 0.8, 0.8 -> +0.1 / 3
    assert rises == pytest.approx([0.15, 0.1 / 3, 0.1 / 3]) and all(g["ok"] for g in res["gate"])
    assert "+0.150 over the 3 evaluations before it" in res["gate"][0]["why"]
    # Too short a curve to have a plateau and the evaluations before it: no number, none printed.
    short = [{"method": "base", "seed": s, "curve": _curve([0.2, 0.5, 0.6, 0.7, 0.8])} for s in range(3)]
    gate = analysis.analyze(short, "base", "align_overall", 1000, **GATE)["gate"]
    assert all(math.isnan(g["rise"]) and "before it" not in g["why"] for g in gate)


def test_three_seeds_give_a_range_and_five_a_bootstrap_interval():
    speeds = [0.5, 0.6, 0.7, 0.8, 0.9]
    runs = []
    for s, v in enumerate(speeds):
        runs += [{"method": "base", "seed": s, "curve": _curve(BASE)},
                 {"method": "x", "seed": s, "curve": _curve([v * (i + 1) for i in range(10)])}]  # fmt: skip
    three = analysis.analyze([r for r in runs if r["seed"] < 3], "base", "align_overall", 1000, **GATE)
    per_seed = [p["speedup"]["step"] for p in three["methods"]["x"]["per_seed"]]
    center, lo, hi = three["methods"]["x"]["speedup"]["step"]
    assert three["methods"]["x"]["interval"] == "range" and (lo, hi) == (min(per_seed), max(per_seed))
    assert center == pytest.approx(math.exp(np.mean(np.log(per_seed))))
    five = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, n_boot=400)
    row = five["methods"]["x"]
    assert row["interval"] == "ci" and row["speedup"]["step"][1] < row["speedup"]["step"][0] < row["speedup"]["step"][2]
    per_seed = [p["speedup"]["step"] for p in row["per_seed"]]
    assert min(per_seed) <= row["speedup"]["step"][1] and row["speedup"]["step"][2] <= max(per_seed)


def _checked_curve(rng, p_right, n=64):
    """A curve whose evaluations keep per-caption checks: each caption's attributes right with probability
    p_right[e] at evaluation e; align_overall is their summary, as the evaluation hook writes it."""
    curve = _curve([0.0] * len(p_right))
    for point, p in zip(curve, p_right, strict=True):
        checks = {a: np.stack([(rng.random(n) < p).astype(int), np.ones(n, int)], 1) for a in alignment.ATTRIBUTES}
        point["align_overall"] = alignment.summarize(checks)["align_overall"]
        point["checks"] = {a: c.tolist() for a, c in checks.items()}
    return curve


def test_the_interval_resamples_captions_within_each_evaluation():
    # Five seeds with identical curves: resampling seeds alone gives a zero-width interval; the captions' own
    # uncertainty, resampled within each evaluation, must widen it.
    rng = np.random.default_rng(0)
    base = _checked_curve(rng, [0.2, 0.4, 0.55, 0.65, 0.75, 0.8, 0.8, 0.8, 0.8, 0.8])
    fast = _checked_curve(rng, [0.5, 0.7, 0.8, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85])
    runs = [{"method": m, "seed": s, "curve": c} for s in range(5) for m, c in (("base", base), ("x", fast))]
    with_captions = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, n_boot=300)
    plain = [{**r, "curve": [{k: v for k, v in p.items() if k != "checks"} for p in r["curve"]]} for r in runs]
    seeds_only = analysis.analyze(plain, "base", "align_overall", 1000, **GATE, n_boot=300)
    c, lo, hi = seeds_only["methods"]["x"]["speedup"]["step"]
    assert lo == pytest.approx(c) and hi == pytest.approx(c)
    c2, lo2, hi2 = with_captions["methods"]["x"]["speedup"]["step"]
    assert c2 == pytest.approx(c) and hi2 - lo2 > 0.1 * c


def _reaching(step, top=0.9):
    """A curve that rises linearly to 0.8 at `step` (exactly at an evaluation or between two), then to `top`."""
    return [min(top, 0.8 * (i + 1) * 100 / step) for i in range(10)]


TWO_BY_TWO = (
    ("pixel, AdamW", "base", "pix"),
    ("pixel, Muon", "base_m", "pix_m"),
    ("Muon, latent", "base", "base_m"),
    ("Muon, pixel", "pix", "pix_m"),
)


def test_the_2x2_is_read_as_four_factors_each_a_ratio_of_two_cells_times():
    # baseline 600 steps to its plateau; baseline with Muon 300, pixel 400 (seed 2: 480), pixel with Muon 200:
    # pixel x1.5 (seed 2: x1.25) with AdamW, x1.5 with Muon; Muon x2 on the latent, x2 (seed 2: x2.4) on pixels
    runs = []
    for s in range(3):
        cells = {
            "base": BASE,
            "base_m": _reaching(300),
            "pix": _reaching(480 if s == 2 else 400),
            "pix_m": _reaching(200),
        }
        runs += [{"method": m, "seed": s, "curve": _curve(c)} for m, c in cells.items()]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, factors=TWO_BY_TWO)
    got = {f["name"]: f for f in res["factors"]}
    assert list(got) == [name for name, *_ in TWO_BY_TWO]
    expect = {"pixel, AdamW": [1.5, 1.5, 1.25], "pixel, Muon": [1.5] * 3, "Muon, latent": [2.0] * 3,
              "Muon, pixel": [2.0, 2.0, 2.4]}  # fmt: skip
    for name, per_seed in expect.items():
        f = got[name]
        assert [p["ratio"]["step"] for p in f["per_seed"]] == pytest.approx(per_seed)
        assert f["ratio"]["step"] == pytest.approx((math.exp(np.mean(np.log(per_seed))), min(per_seed), max(per_seed)))
        assert f["interval"] == "range" and f["bound"] is None
        assert f["ratio"]["wall_s"][0] == pytest.approx(f["ratio"]["step"][0])  # same seconds per step in every cell


def test_a_censored_cell_bounds_its_factors_and_a_missing_one_drops_them():
    runs = []
    for s in range(3):
        cells = {"base": BASE, "base_m": _reaching(300), "pix": [0.1] * 10}  # pixel never reaches; no pixel+Muon
        runs += [{"method": m, "seed": s, "curve": _curve(c)} for m, c in cells.items()]
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, factors=TWO_BY_TWO)
    got = {f["name"]: f for f in res["factors"]}
    assert set(got) == {"pixel, AdamW", "Muon, latent"}  # the factors with pixel+Muon need its runs
    assert got["pixel, AdamW"]["bound"] == "upper" and got["pixel, AdamW"]["ratio"]["step"][0] == pytest.approx(0.6)
    assert got["Muon, latent"]["bound"] is None
    swapped = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, factors=(("x", "pix", "base_m"),))
    f = swapped["factors"][0]
    assert f["bound"] == "lower" and f["ratio"]["step"][0] == pytest.approx(1000 / 300)


def test_a_factors_interval_from_five_seeds_comes_from_the_same_resamples_as_its_cells():
    rng = np.random.default_rng(1)
    runs = []
    for s in range(5):
        t_pix, t_pm = rng.uniform(300, 500), rng.uniform(150, 300)
        runs += [{"method": m, "seed": s, "curve": _curve(c)}
                 for m, c in (("base", BASE), ("pix", _reaching(t_pix)), ("pix_m", _reaching(t_pm)))]  # fmt: skip
    res = analysis.analyze(runs, "base", "align_overall", 1000, **GATE, n_boot=400, factors=(("Muon", "pix", "pix_m"),))
    f = res["factors"][0]
    per_seed = [p["ratio"]["step"] for p in f["per_seed"]]
    center, lo, hi = f["ratio"]["step"]
    assert f["interval"] == "ci" and min(per_seed) <= lo < center < hi <= max(per_seed)
    # the factor's center is the ratio of its cells' centers (geometric means over the same seeds)
    cells = res["methods"]
    assert center == pytest.approx(cells["pix_m"]["speedup"]["step"][0] / cells["pix"]["speedup"]["step"][0])

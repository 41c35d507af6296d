"""The crossing rule (speedup/target.py): interpolation, sustain, a lucky evaluation, lower-is-better metrics;
against hand-computed curves. The protocol on top of it (plateau target, per-seed gate, censoring, intervals) is
tested in test_analysis.py."""

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

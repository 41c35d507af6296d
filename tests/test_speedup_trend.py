"""The trend with resolution: each size's headline read from its results.json, the speedups put side by side and
plotted against the image size (speedup/trend.py, `bench_speedup.py --trend`)."""

import dataclasses
import json
import math

import pytest

from reve_jax.speedup import protocol, runner, trend
from reve_jax.speedup.cli import main


def _results(px, per_seed_speed, *, baseline="latent", fail_gate=False, render=None):
    """A finished headline at `px`: baseline A plateaus at 0.8 by step 600 (0.3 when `fail_gate`); the recipe
    reaches 0.8 `per_seed_speed[s]` times sooner on seed s (exact at evaluation points)."""
    size = dataclasses.replace(protocol.load_protocol("configs/speedup/cpu30.py"), name=f"px{px}", baseline=baseline,
                               seeds=tuple(range(len(per_seed_speed))), steps=1000, evals=10)  # fmt: skip
    base = [0.1, 0.15, 0.2, 0.25, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3] if fail_gate else [0.2, 0.4, 0.5, 0.6, 0.7] + [0.8] * 5
    config = json.dumps({"data": {"image_size": px, **({"render": render} if render else {})}})

    def curve(values):
        return [{"step": 100 * (i + 1), "samples": 3200 * (i + 1), "flops": 1e12 * (i + 1), "wall_s": 50.0 * (i + 1),
                 "cpu_s": 100.0 * (i + 1), "align_overall": v} for i, v in enumerate(values)]  # fmt: skip

    runs = []
    for s, k in enumerate(per_seed_speed):
        fast = [min(0.9, 0.8 * (i + 1) / (6 / k)) for i in range(10)]
        runs += [{"method": baseline, "seed": s, "curve": curve(base), "config": config},
                 {"method": "recipe", "seed": s, "curve": curve(fast), "config": config}]  # fmt: skip
    return {"size": dataclasses.asdict(size), "methods": [baseline, "recipe"], "runs": runs,
            "summary": runner.summarize(size, runs)}  # fmt: skip


def _write(tmp_path, name, res):
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(res))
    return str(d)


def test_the_trend_puts_each_sizes_speedup_at_its_resolution():
    at64, at32 = _results(64, [3.0, 3.0, 3.0]), _results(32, [1.5, 2.0, 3.0])
    rows = trend.rows([at64, at32])  # any order in, increasing resolution out
    assert [(r["resolution"], r["method"]) for r in rows] == [(32, "recipe"), (64, "recipe")]
    c, lo, hi = rows[0]["speedup"]["step"]
    assert c == pytest.approx(math.prod([1.5, 2.0, 3.0]) ** (1 / 3)) and (lo, hi) == pytest.approx((1.5, 3.0))
    assert rows[0]["interval"] == "range" and not rows[0]["upper_bound"] and rows[0]["reached"] == 3
    assert rows[1]["speedup"]["flops"][0] == pytest.approx(3.0)
    md = trend.markdown(rows)  # a config from before data.render was in the fixed rendering
    assert "| px32 | 32 | fixed | JIT-DDT recipe | 3/3 | 2.08x (range 1.50x-3.00x) |" in md
    assert "| px64 | 64 | fixed | JIT-DDT recipe | 3/3 | 3.00x |" in md


def test_a_control_in_another_rendering_is_its_own_point_not_a_step_of_the_line(tmp_path):
    """cpu30 (jittered), cpu30f (fixed, the same 32 px) and cpu64 (fixed, 64 px): the resolution's line joins the
    two fixed points; the jittered one stands apart, and the table names each point's rendering."""
    jit32 = _results(32, [2.0, 2.0, 2.0], render="jitter")
    fix32, fix64 = _results(32, [1.5, 1.5, 1.5], render="fixed"), _results(64, [1.0, 1.0, 1.0], render="fixed")
    rows = trend.rows([fix64, jit32, fix32])
    assert [(r["resolution"], r["render"]) for r in rows] == [(32, "fixed"), (32, "jitter"), (64, "fixed")]
    lines = trend.series(rows)
    assert {k: [r["resolution"] for r in v] for k, v in lines.items()} == {
        ("recipe", "fixed"): [32, 64],
        ("recipe", "jitter"): [32],
    }
    assert lines[("recipe", "fixed")][1]["speedup"]["step"][0] == pytest.approx(1.0)
    assert "| px32 | 32 | jitter | JIT-DDT recipe | 3/3 | 2.00x |" in trend.markdown(rows)
    assert trend.plot(rows, tmp_path / "t.png").stat().st_size > 0
    mixed = _results(32, [2.0, 2.0, 2.0], render="fixed")
    mixed["runs"][0]["config"] = json.dumps({"data": {"image_size": 32, "render": "jitter"}})
    with pytest.raises(trend.TrendError, match=r"renderings \['fixed', 'jitter'\]; a trend point needs one"):
        trend.rows([mixed])


def test_a_method_that_never_reaches_the_target_prints_never_beside_its_bound(tmp_path):
    rows = trend.rows([_results(32, [2.0, 2.0, 2.0]), _results(64, [0.5, 0.5, 0.5])])  # at 64: 0.8 after the budget
    assert [(r["reached"], r["upper_bound"]) for r in rows] == [(3, False), (0, True)]
    md = trend.markdown(rows)
    assert "| px32 | 32 | fixed | JIT-DDT recipe | 3/3 | 2.00x |" in md
    assert "| px64 | 64 | fixed | JIT-DDT recipe | 0/3 | never (<=" in md
    assert trend.plot(rows, tmp_path / "t.png").stat().st_size > 0


def test_a_size_whose_baseline_fails_the_gate_is_listed_not_plotted(tmp_path):
    rows = trend.rows([_results(32, [2.0, 2.0, 2.0]), _results(64, [2.0, 2.0, 2.0], fail_gate=True)])
    assert [r["ok"] for r in rows] == [True, False]
    assert "no speedup measurable" in rows[1]["why"]
    assert "**no speedup measurable" in trend.markdown(rows)
    assert trend.plot(rows, tmp_path / "t.png").stat().st_size > 0


def test_the_trend_command_writes_its_table_and_plot_and_refuses_mixed_baselines(tmp_path, capsys):
    a = _write(tmp_path, "a", _results(32, [1.5, 2.0, 3.0]))
    b = _write(tmp_path, "b", _results(64, [3.0, 3.0, 3.0]))
    main(["--trend", a, b, "--out", str(tmp_path / "t")])
    assert (tmp_path / "t" / "trend.png").stat().st_size > 0
    assert [r["resolution"] for r in json.loads((tmp_path / "t" / "trend.json").read_text())] == [32, 64]
    assert "| px64 | 64 | fixed | JIT-DDT recipe |" in capsys.readouterr().out
    c = _write(tmp_path, "c", _results(64, [3.0, 3.0, 3.0], baseline="pixel"))
    with pytest.raises(SystemExit, match="different baselines"):
        main(["--trend", a, c, "--out", str(tmp_path / "t2")])
    mixed = _results(64, [3.0, 3.0, 3.0])
    mixed["runs"][0]["config"] = json.dumps({"data": {"image_size": 32}})
    with pytest.raises(SystemExit, match=r"image sizes \[32, 64\]; a trend point needs one"):
        main(["--trend", a, _write(tmp_path, "mixed", mixed), "--out", str(tmp_path / "t4")])
    with pytest.raises(SystemExit, match="results.json not found"):
        main(["--trend", a, str(tmp_path), "--out", str(tmp_path / "t3")])


def test_the_trend_dry_run_checks_the_directories_and_the_finished_ones(tmp_path, capsys):
    a = _write(tmp_path, "a", _results(32, [1.5, 2.0, 3.0]))
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit) as done:
        main(["--trend", a, str(tmp_path / "b"), "--dry-run"])
    assert done.value.code == 0
    assert "trend of 1 rows from 1 finished" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a directory"):
        main(["--trend", a, str(tmp_path / "nope"), "--dry-run"])

"""The speedup benchmark's analysis (time to target, summaries, the report), its size files, and a benchmark run
end to end as trainer runs with the evaluation hook (resumable)."""

import json
import time

import jax
import numpy as np
import pytest

from reve_jax.data import pipeline
from reve_jax.eval import alignment, report, speedup

SIZES = {name: f"configs/speedup/{name}.py" for name in ("cpu", "cpu_p4", "gpu")}


def _size(name):
    return speedup.load_protocol(SIZES[name])


# ------------------------------------------------------------------------------------------ speedup analysis


def test_first_reach_on_synthetic_curves():
    steps = [100, 200, 300, 400]
    assert speedup.first_reach(steps, [0.1, 0.4, 0.6, 0.8], 0.5) == 300
    assert speedup.first_reach(steps, [0.1, 0.4, 0.6, 0.8], 0.6) == 300  # reaching means >=
    assert speedup.first_reach(steps, [0.1, 0.4, 0.6, 0.8], 0.5, interpolate=True) == pytest.approx(250)
    assert speedup.first_reach(steps, [0.7, 0.4, 0.6, 0.8], 0.5, interpolate=True) == 100  # first point already
    assert speedup.first_reach(steps, [0.1, 0.2, 0.3, 0.4], 0.5) is None
    assert speedup.first_reach(steps, [0.1, np.nan, 0.2, 0.9], 0.5) == 400
    # A non-monotone curve: the FIRST crossing counts even if it falls back later.
    assert speedup.first_reach(steps, [0.1, 0.6, 0.3, 0.4], 0.5) == 200
    # Sustained: a lucky evaluation that the next one does not confirm is not a crossing; the last counts alone.
    assert speedup.first_reach(steps, [0.1, 0.6, 0.3, 0.6], 0.5, sustain=2) == 400
    assert speedup.first_reach(steps, [0.1, 0.6, 0.7, 0.3], 0.5, sustain=2) == 200
    assert speedup.first_reach(steps, [0.1, 0.6, 0.3, 0.4], 0.5, sustain=2) is None
    # Lower is better (FD, v-loss).
    assert speedup.first_reach(steps, [9.0, 5.0, 2.0, 1.0], 3.0, higher_is_better=False) == 300
    assert speedup.first_reach(steps, [9.0, 5.0, 2.0, 1.0], 3.0, False, interpolate=True) == pytest.approx(
        200 + 100 * 2 / 3
    )


def _curve(values, step_s, every=100, batch=8, img_flops=1e9):
    return [
        {
            "step": every * (i + 1),
            "samples": every * (i + 1) * batch,
            "flops": every * (i + 1) * batch * img_flops,
            "wall_s": every * (i + 1) * step_s,
            "cpu_s": every * (i + 1) * step_s * 2,
            "align_overall": v,
            "align_exact": v / 2,
            "fd_shapes": 10 * (1 - v),
            "vloss": 1 - v,
        }
        for i, v in enumerate(values)
    ]


def _runs():
    def run(method, values, step_s, seed, chosen=True):
        return {"method": method, "seed": seed, "lr": 1e-3, "chosen": chosen, "curve": _curve(values, step_s)}

    return {
        "b0": run("baseline", [0.2, 0.4, 0.5, 0.6], 1.0, 0),
        "b1": run("baseline", [0.2, 0.3, 0.5, 0.6], 1.0, 1),
        "b_lr": run("baseline", [0.1, 0.1, 0.1, 0.1], 1.0, 0, chosen=False),  # a losing LR: not counted
        "r0": run("recipe", [0.4, 0.7, 0.8, 0.9], 2.0, 0),  # twice the steps' speed, each step twice as slow
        "r1": run("recipe", [0.3, 0.6, 0.8, 0.9], 2.0, 1),
        "t0": run("tread", [0.1, 0.2, 0.3, 0.4], 0.5, 0),  # never reaches
        "t1": run("tread", [0.1, 0.2, 0.6, 0.6], 0.5, 1),  # reaches at 300 and holds
    }


def test_summary_speedups_and_not_reached():
    runs = _runs()
    assert speedup.targets_of(runs)["align_overall"] == pytest.approx(0.6)
    s = speedup.summarize(runs)
    assert s["baseline"]["step"] == (400.0, 0.0) and s["baseline"]["reached"] == 2
    assert s["recipe"]["step"] == (200.0, 0.0)
    assert s["recipe"]["speedup_step"] == pytest.approx(2.0)
    assert s["recipe"]["speedup_wall_s"] == pytest.approx(1.0)  # 400 s either way
    assert s["recipe"]["speedup_flops"] == pytest.approx(2.0)
    assert s["tread"]["reached"] == 1 and s["tread"]["step"] == (300.0, 0.0)
    assert s["tread"]["final_align_overall"] == (pytest.approx(0.5), pytest.approx(0.1))
    runs["t1"]["curve"][3]["align_overall"] = 0.4  # reached once, not held: not a crossing
    assert speedup.summarize(runs)["tread"]["reached"] == 0
    assert speedup.summarize(runs, sustain=1)["tread"]["reached"] == 1
    runs.pop("t1")
    s = speedup.summarize(runs)
    assert s["tread"]["reached"] == 0 and s["tread"]["step"] is None and s["tread"]["speedup_step"] is None
    md = report.markdown_table({"summary": {"align_overall": s}, "targets": speedup.targets_of(runs)})
    assert "not reached" in md and "| full recipe | 2/2 | 200 |" in md
    assert "did not improve" not in md  # these baselines improve on every metric
    flat = {k: {**r, "curve": [{**p, "align_overall": 0.3} for p in r["curve"]]} for k, r in runs.items()}
    assert "did not improve on caption alignment" in report.markdown_table(
        {"summary": {"align_overall": s}, "targets": speedup.targets_of(runs), "runs": flat}
    )


def test_report_writes_table_and_plot(tmp_path):
    runs = _runs()
    results = {
        "size": {"name": "test"},
        "targets": speedup.targets_of(runs),
        "summary": {m: speedup.summarize(runs, m) for m in ("align_overall", "fd_shapes", "vloss")},
        "runs": runs,
    }
    report.write_outputs(results, tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    assert "baseline + tread" in (tmp_path / "speedup.md").read_text()


def test_benchmark_configs_differ_only_in_their_techniques():
    size = _size("cpu")
    base = speedup.build_config(size, "baseline", 1e-3, 0)
    recipe = speedup.build_config(size, "recipe", 1e-3, 0)
    assert (base.model.width, base.train.steps, base.optim.schedule, base.optim.lr) == (128, size.steps, "cosine", 1e-3)
    assert base.diffusion.prediction == "v" and base.model.bottleneck == 0 and not base.model.route.enabled
    assert recipe.diffusion.prediction == "x" and recipe.model.bottleneck > 0 and recipe.model.route.enabled
    assert recipe.optim.name == "muon" and recipe.sample.to_dict() == base.sample.to_dict()
    tread = speedup.build_config(size, "tread", 1e-3, 1)
    assert tread.model.route.enabled and tread.diffusion.prediction == "v" and tread.seed == 1
    for name in SIZES:  # every method of every size is a valid config
        size = _size(name)
        for method in ("baseline", *size.methods, "ddt", "recipe+ddt"):
            cfg = speedup.build_config(size, method, size.lrs[0], size.seeds[-1])
            assert cfg.train.steps == size.steps and cfg.optim.schedule == "cosine", (name, method)
    assert jax.device_count() == 8  # conftest's emulated devices: the configs build without touching them


def test_rescore_recomputes_alignment_from_saved_images(tmp_path):
    """A finished benchmark's alignment is recomputed from the images it saved: the dataset's own images score 1,
    uniform noise scores at most chance; FD and v-loss stay; results.json and the report are rewritten."""
    size = _size("cpu")
    cfg = speedup.build_config(size, "baseline", 1e-3, 0)
    ds = pipeline.dataset_from_config(cfg.data)
    index = np.arange(len(ds) - 12, len(ds))
    real = np.stack([ds[int(i)]["image"] for i in index])
    noise = np.random.default_rng(0).integers(0, 256, real.shape).astype(np.uint8)
    (tmp_path / "runs").mkdir()
    runs = {}
    for key, method, images in (("b", "baseline", real), ("r", "recipe", noise)):
        curve = _curve([0.2, 0.5], 1.0)  # stale alignment values; FD and v-loss improve
        np.savez_compressed(tmp_path / "runs" / f"{key}.npz", index=index, step_100=images, step_200=images)
        runs[key] = {"method": method, "seed": 0, "lr": 1e-3, "chosen": True, "curve": curve}
        runs[key]["config"] = speedup.config_lib.to_json(cfg)
    results = {"size": {"name": "test"}, "runs": runs, "targets": {}, "summary": {}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = speedup.rescore(tmp_path, log=lambda s: None)
    b, r = out["runs"]["b"]["curve"][-1], out["runs"]["r"]["curve"][-1]
    assert b["align_overall"] == 1.0 and b["align_exact"] == 1.0
    assert r["align_overall"] < 0.2 and r["align_background"] <= alignment.CHANCE["background"] + 0.1
    assert b["fd_shapes"] == runs["b"]["curve"][-1]["fd_shapes"]  # only the alignment is recomputed
    assert out["targets"]["align_overall"] == 1.0
    assert json.loads((tmp_path / "runs" / "r.json").read_text())["curve"][-1]["align_overall"] < 0.2
    md = (tmp_path / "speedup.md").read_text()
    assert "not reached" in md
    # The baseline's alignment is the same at both evaluations: its target is its starting level, and says so.
    assert "did not improve on caption alignment" in md and "did not improve on FD-shapes" not in md
    with pytest.raises(FileNotFoundError, match="results.json"):
        speedup.rescore(tmp_path / "missing")


class _Crash(Exception):
    pass


def test_a_benchmark_run_is_a_resumable_trainer_run(tmp_path):
    """train_run is the trainer with the evaluation hook: a run killed after an evaluation but before the checkpoint
    of that step resumes from the previous checkpoint, evaluates that step again on the same weights, and ends with
    the curve of an uninterrupted run; its training clock carries over and excludes evaluation."""
    size = _size("cpu")
    tiny = (
        "model.width=32",
        "model.depth=3",
        "model.heads=2",
        "text.width=32",
        "data.image_size=16",
        "model.patch=4",
        "train.global_batch=8",
        "data.worker_threads=0",
        "sample.steps=2",
        "train.ckpt_async=False",
    )
    cfg = speedup.build_config(speedup.dataclasses.replace(size, steps=6, eval_every=2), "recipe", 1e-3, 0, tiny)
    kwargs = {"feature_spec": None}
    t0 = time.perf_counter()
    straight = speedup.train_run(cfg, tmp_path / "straight", 2, 8, 4321, kwargs)
    elapsed = time.perf_counter() - t0

    def crash_at_4(point):
        if point["step"] == 4:
            raise _Crash

    with pytest.raises(_Crash):
        speedup.train_run(cfg, tmp_path / "split", 2, 8, 4321, kwargs, on_eval=crash_at_4)
    split = speedup.train_run(cfg, tmp_path / "split", 2, 8, 4321, kwargs)
    assert [p["step"] for p in split["curve"]] == [p["step"] for p in straight["curve"]] == [2, 4, 6]
    for a, b in zip(straight["curve"], split["curve"], strict=True):
        for k in ("align_overall", "vloss", "train_loss", "samples", "flops"):
            assert a[k] == b[k], (k, a[k], b[k])
    walls = [p["wall_s"] for p in split["curve"]]
    assert 0 < walls[0] < walls[1] < walls[2]
    # The clock excludes compilation and the evaluations.
    evals = sum(p["eval_s"] for p in straight["curve"])
    assert straight["curve"][-1]["wall_s"] < elapsed - evals - straight["compile_s"]
    assert straight["diverged"] is None and straight["step_flops"] > 0

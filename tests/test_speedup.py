"""The speedup benchmark: its size files and methods, the report, rescoring from saved images, and a benchmark run
end to end as a resumable trainer run with the evaluation hook."""

import dataclasses
import json
import os
import signal
import time

import jax
import numpy as np
import pytest

from reve_jax import xla
from reve_jax.data import pipeline
from reve_jax.data.synthetic import alignment
from reve_jax.speedup import protocol, report, runner, sweeps

SIZES = {name: f"configs/speedup/{name}.py" for name in ("cpu", "cpu30", "cpu30f", "cpu64", "gpu")}


def _size(name):
    return protocol.load_protocol(SIZES[name])


def _curve(values, step_s=1.0, every=100, batch=8, img_flops=1e9):
    return [
        {"step": every * (i + 1), "samples": every * (i + 1) * batch, "flops": every * (i + 1) * batch * img_flops,
         "wall_s": every * (i + 1) * step_s, "cpu_s": 2 * every * (i + 1) * step_s, "align_overall": v,
         "align_exact": v / 2, "kid": 0.1 * (1 - v), "vloss": 1 - v}
        for i, v in enumerate(values)
    ]  # fmt: skip


# Three seeds; every curve has five evaluations (steps 100..500). The baseline's plateau (the mean of its last three)
# is 0.6 on every seed, which it first reaches at step 300 (from 0.4 at 200) and holds. The recipe's crossings of
# 0.6, interpolated: seed 0 (0.5 -> 0.7) at 150, seed 1 (0.4 -> 0.7) at 100 + 100 * 0.2 / 0.3, seed 2 (0.5 at 200
# -> 0.7 at 300) at 250. "never" stays under the target: censored at the full budget.
BASE = [0.2, 0.4, 0.6, 0.6, 0.6]
RECIPE = {0: [0.5, 0.7, 0.8, 0.9, 0.9], 1: [0.4, 0.7, 0.8, 0.9, 0.9], 2: [0.3, 0.5, 0.7, 0.8, 0.8]}
RECIPE_STEPS = np.array([150.0, 100 + 100 * 0.2 / 0.3, 250.0])


def _runs():
    runs = []
    for seed in range(3):
        runs.append({"method": "latent", "seed": seed, "curve": _curve(BASE)})
        runs.append({"method": "recipe", "seed": seed, "curve": _curve(RECIPE[seed], step_s=2.0)})
        runs.append({"method": "never", "seed": seed, "curve": _curve([0.1, 0.2, 0.3, 0.4, 0.5])})
    return runs


def test_methods_differ_only_in_their_techniques_and_every_size_builds():
    size = _size("cpu")
    base = protocol.build_config(size, "pixel_p8", 0)
    recipe = protocol.build_config(size, "recipe", 1)
    assert (base.model.width, base.train.steps, base.optim.schedule) == (128, size.steps, "cosine")
    assert base.diffusion.prediction == "v" and base.model.bottleneck == 0 and base.model.arch == "dit"
    assert recipe.diffusion.prediction == "x" and recipe.model.bottleneck > 0 and recipe.model.arch == "ddt"
    assert recipe.seed == recipe.data.seed == 1  # a seed sets the data too
    assert recipe.train.ckpt_every == size.eval_every == size.steps // size.evals
    lat = protocol.build_config(size, "latent", 0)
    assert lat.latent.path and lat.diffusion.prediction == "v" and lat.model.patch == 2
    pixel = protocol.build_config(size, "pixel", 0)
    assert pixel.model.patch == 4 and pixel.diffusion.prediction == "v"
    # the baselines at 64 tokens (where they learned best), the recipe at 16 (JiT's large patches)
    assert (lat.data.image_size // lat.latent.downsample // lat.model.patch) ** 2 == 64
    assert (pixel.data.image_size // pixel.model.patch) ** 2 == 64
    assert (recipe.data.image_size // recipe.model.patch) ** 2 == 16
    no_ddt = protocol.build_config(size, "recipe-ddt", 0)
    assert no_ddt.model.arch == "dit"
    # a leave-one-out ablation changes one technique: it keeps the recipe's frozen LR and guidance
    assert (no_ddt.optim.lr, no_ddt.sample.cfg_scale) == (recipe.optim.lr, recipe.sample.cfg_scale)
    assert (recipe.optim.lr, recipe.sample.cfg_scale) != (lat.optim.lr, lat.sample.cfg_scale)
    prx = protocol.build_config(size, "prx", 0)
    assert prx.model.route.enabled and prx.optim.name == "muon"
    # Optimizer rates come from the size's FROZEN entry or the sweep, never from the experiment config the size
    # starts from (tiny.py tunes Muon's rate for its own job): Muon takes `lr` unless the entry freezes its own.
    from configs.speedup import cpu

    assert prx.optim.muon_lr == cpu.FROZEN["prx"]["muon_lr"]
    assert lat.optim.muon_lr == recipe.optim.muon_lr == 0.0
    assert protocol.build_config(size, "jit+muon", 0).optim.muon_lr == 0.0
    for name in SIZES:  # every method of every size is a valid config
        s = _size(name)
        for method in (s.baseline, *s.methods, *s.further):
            cfg = protocol.build_config(s, method, s.seeds[-1])
            assert cfg.train.steps == s.steps and cfg.optim.schedule == "cosine", (name, method)
    with pytest.raises(ValueError, match="no technique"):
        protocol.build_config(size, "recipe-muon", 0)
    # the PRX variant's leave-one-out ablations: one technique off, PRX's frozen rates and guidance kept
    no_tread, no_muon = (protocol.build_config(size, m, 0) for m in ("prx-tread", "prx-muon"))
    assert not no_tread.model.route.enabled and no_tread.optim.name == "muon"
    assert no_muon.model.route.enabled and no_muon.optim.name == "adamw"
    for cfg in (no_tread, no_muon):
        assert (cfg.optim.lr, cfg.optim.muon_lr, cfg.sample.cfg_scale) == (
            prx.optim.lr, prx.optim.muon_lr, prx.sample.cfg_scale)  # fmt: skip
        assert cfg.model.arch == "ddt" and cfg.loss.repa_weight > 0
    with pytest.raises(ValueError, match="no technique"):
        protocol.build_config(size, "prx-latent", 0)
    # baseline A with Muon (cpu30's 2x2): baseline A's latent tokens, both rates its own (each arm is swept alike)
    from configs.speedup import cpu30

    s30 = _size("cpu30")
    lat30, lat_muon = (protocol.build_config(s30, m, 0) for m in ("latent", "latent+muon"))
    assert lat_muon.model.patch == lat30.model.patch == 2 and lat_muon.latent.path == lat30.latent.path
    assert (lat30.optim.name, lat_muon.optim.name) == ("adamw", "muon")
    frozen = cpu30.FROZEN["latent"]
    assert (lat30.optim.lr, lat30.sample.cfg_scale) == (frozen["lr"], frozen["cfg_scale"])
    assert lat_muon.optim.lr == cpu30.FROZEN["latent+muon"]["lr"]
    assert lat_muon.optim.muon_lr == cpu30.FROZEN["latent+muon"]["muon_lr"] != lat_muon.optim.lr
    # the recipe with Muon: its own sweep's rates and guidance (the PRX variant's rates, its own guidance)
    rec_muon = protocol.build_config(s30, "recipe+muon", 0)
    got = {"lr": rec_muon.optim.lr, "muon_lr": rec_muon.optim.muon_lr, "cfg_scale": rec_muon.sample.cfg_scale}
    assert rec_muon.optim.name == "muon" and got == cpu30.FROZEN["recipe+muon"] != cpu30.FROZEN["prx"]
    # JiT's resolution rule between the trend's sizes: cpu64 doubles cpu30's side and the recipe's patch (the same
    # token count), so its pixel-space methods double the noise scale; baseline A's latent grid is the same at both
    # sizes, and so is its noise scale
    s64 = _size("cpu64")
    for m in ("recipe", "recipe+muon", "pixel", "latent", "latent+muon"):
        a, b = protocol.build_config(s30, m, 0), protocol.build_config(s64, m, 0)
        assert b.data.image_size == 2 * a.data.image_size
        if m.startswith("recipe"):
            assert (b.model.patch, b.data.image_size // b.model.patch) == (
                2 * a.model.patch,
                a.data.image_size // a.model.patch,
            )
        want = a.diffusion.noise_scale * (1.0 if m.startswith("latent") else 2.0)
        assert b.diffusion.noise_scale == want, (m, b.diffusion.noise_scale)
    # cpu30f, the trend's control: cpu30 in cpu64's rendering, nothing else changed but the rate and guidance its
    # own sweeps froze, on cpu30's autoencoder (the same cache entry, so the same one-time cost)
    from configs.speedup import cpu30f
    from reve_jax.latent import training as latent_training

    s30f = _size("cpu30f")
    for m in ("recipe", "latent", "latent+muon"):
        a, b = protocol.build_config(s30, m, 10), protocol.build_config(s30f, m, 10)
        assert (a.data.render, b.data.render, b.latent.train_render) == ("jitter", "fixed", "jitter")
        assert (b.optim.lr, b.sample.cfg_scale) == (cpu30f.FROZEN[m]["lr"], cpu30f.FROZEN[m]["cfg_scale"]), m
        da, db = json.loads(a.to_json()), json.loads(b.to_json())
        for d in (da, db):
            del d["data"]["render"], d["latent"]["train_render"], d["optim"]["lr"], d["sample"]["cfg_scale"]
        assert da == db, m
        assert latent_training.cache_key(a) == latent_training.cache_key(b), m
    assert jax.device_count() == 8  # conftest's emulated devices: the configs build without touching them


def test_report_gate_table_and_plot(tmp_path):
    """The headline row against the crossings computed by hand (RECIPE_STEPS): each seed's speedup is the baseline's
    cost to its plateau (step 300) over the method's; the row prints their geometric mean and, under five seeds,
    their range; a method that never reaches the target is censored at the full budget and printed as a bound."""
    size = dataclasses.replace(_size("cpu"), seeds=(0, 1, 2), steps=500, evals=5, gate_final=0.5, gate_gain=0.2)
    runs = _runs()
    results = {"size": dataclasses.asdict(size), "runs": runs, "summary": runner.summarize(size, runs)}
    report.write_outputs(results, tmp_path)
    md = (tmp_path / "speedup.md").read_text()
    assert md.count("gate passed") == 3 and "passes the gate on 3 of 3 seeds" in md
    tt = results["summary"]["time_to_target"]
    rec = tt["methods"]["recipe"]
    np.testing.assert_allclose([p["cost"]["step"] for p in rec["per_seed"]], RECIPE_STEPS, rtol=1e-6)
    np.testing.assert_allclose([p["cost"]["wall_s"] for p in rec["per_seed"]], 2 * RECIPE_STEPS, rtol=1e-6)
    base = tt["methods"]["latent"]
    assert [p["cost"]["step"] for p in base["per_seed"]] == pytest.approx([300.0] * 3)
    steps_x, wall_x = 300 / RECIPE_STEPS, 300 / (2 * RECIPE_STEPS)  # the baseline's step takes 1 s, the recipe's 2
    assert rec["interval"] == "range" and rec["reached"] == 3 and not rec["upper_bound"]
    for got, want in ((rec["speedup"]["step"], steps_x), (rec["speedup"]["wall_s"], wall_x)):
        np.testing.assert_allclose(got, [np.exp(np.log(want).mean()), want.min(), want.max()], rtol=1e-6)
    row = next(ln for ln in md.splitlines() if ln.startswith("| JIT-DDT recipe | 3/3"))
    g = np.exp(np.log(steps_x).mean())
    assert f"{g:.2f}x (range {steps_x.min():.2f}x-{steps_x.max():.2f}x)" in row, row
    never = tt["methods"]["never"]
    assert never["reached"] == 0 and never["upper_bound"]
    assert [p["cost"]["step"] for p in never["per_seed"]] == pytest.approx([500.0] * 3)  # the full budget
    assert next(ln for ln in md.splitlines() if ln.startswith("| never | 0/3")).count("<=0.60x") >= 1
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    # A baseline that does not learn on two seeds fails their gates: no speedup is reported at all.
    flat = [dict(r, curve=_curve([0.3, 0.3, 0.35, 0.4, 0.4])) if r["method"] == "latent" and r["seed"] else r
            for r in runs]  # fmt: skip
    md = report.markdown_table({"size": dataclasses.asdict(size), "runs": flat,
                                "summary": runner.summarize(size, flat)})  # fmt: skip
    assert md.count("gate **failed**") == 2 and "no speedup measurable" in md and "| JIT-DDT recipe | 3/3" not in md


def test_the_plot_drops_wall_clock_when_runs_were_reused(tmp_path, monkeypatch):
    """The figure follows the table's rule: wall clock compares runs of one invocation, so with any reused run its
    time axis is executed FLOPs (in TFLOP: the curve's own values scaled, not another run's)."""
    import matplotlib.axes

    size = dataclasses.replace(_size("cpu"), seeds=(0, 1, 2), steps=500, evals=5, gate_final=0.5, gate_gain=0.2)
    runs = _runs()
    fresh = {"size": dataclasses.asdict(size), "runs": runs}
    reused = dict(fresh, runs=[dict(r, reused=True) if i == 0 else r for i, r in enumerate(runs)])
    assert report.x_axes(fresh) == ("wall_s", "step") and report.x_axes(reused) == ("flops", "step")
    drawn, orig = [], matplotlib.axes.Axes.plot

    def spy(ax, xs, *a, **k):
        drawn.append(list(np.asarray(xs, np.float64)))
        return orig(ax, xs, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    report.plot(reused, tmp_path / "r.png")
    half = len(drawn)  # the reused figure's lines, then the fresh one's
    report.plot(fresh, tmp_path / "f.png")
    curve = next(r for r in runs if r["method"] == "recipe")["curve"]  # 2 s a step: wall, steps, FLOPs all differ
    wall, tflop = [p["wall_s"] for p in curve], [p["flops"] * 1e-12 for p in curve]
    assert any(xs == pytest.approx(tflop) for xs in drawn[:half]) and wall not in drawn[:half]
    assert wall in drawn[half:] and not any(xs == pytest.approx(tflop) for xs in drawn[half:])


def test_kid_axis_is_logarithmic_unless_a_value_is_not_positive():
    assert report.kid_scale([0.03, 4.5]) == ("log", {})
    assert report.kid_scale([0.03, -0.0002, 0.0]) == ("symlog", {"linthresh": 1e-3})


def test_report_names_the_machines_and_flags_a_mix():
    """The report says which CPUs the runs trained on, and warns when reused runs mix machines."""
    amd = {"cpu": "AMD EPYC 7B13", "cpus": 2, "devices": ["cpu"]}
    intel = dict(amd, cpu="Intel(R) Xeon(R) Processor")
    one = report.machines_line([{"machine_start": amd}, {"machine_start": amd}])
    assert one == "Trained on: AMD EPYC 7B13, 2 CPUs, cpu (2 runs)."
    mixed = report.machines_line([{"machine_start": amd}, {"machine_start": intel}, {}])
    assert "AMD EPYC 7B13, 2 CPUs, cpu (1 run)" in mixed and "Intel(R) Xeon(R) Processor, 2 CPUs, cpu (1 run)" in mixed
    assert "CPU model not recorded" in mixed and "not wall or CPU seconds" in mixed
    assert protocol.machine()["cpu"] == xla.cpu_model() != ""


def test_rescore_recomputes_alignment_from_saved_images(tmp_path):
    """A finished benchmark's alignment is recomputed from the images it saved: the dataset's own images score 1,
    uniform noise scores little; the FLOP cost is recounted; other metrics stay; results.json and the report are
    rewritten."""
    size = dataclasses.replace(_size("cpu"), seeds=(0,), steps=200, evals=2)
    cfg = protocol.build_config(size, "pixel_p8", 0)
    ds = pipeline.eval_dataset(cfg.data, "unseen")
    index = np.arange(12)
    real = np.stack([ds[int(i)]["image"] for i in index])
    noise = np.random.default_rng(0).integers(0, 256, real.shape).astype(np.uint8)
    (tmp_path / "runs").mkdir()
    runs = []
    for method, images in (("latent", real), ("recipe", noise)):
        key = runner._run_key(size, method, 0, ())
        np.savez_compressed(tmp_path / "runs" / f"{key}.npz", index=index, split="unseen", step_100=images,
                            step_200=images)  # fmt: skip
        runs.append(
            {"method": method, "seed": 0, "curve": _curve([0.2, 0.5]), "config": runner.config_lib.to_json(cfg)}
        )
    results = {"size": dataclasses.asdict(size), "runs": runs, "summary": {}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = runner.rescore(tmp_path, log=lambda s: None)
    b, r = out["runs"][0]["curve"][-1], out["runs"][1]["curve"][-1]
    assert b["align_overall"] == 1.0 and b["align_exact"] == 1.0
    assert r["align_overall"] < 0.2 and r["align_background"] <= alignment.CHANCE["background"] + 0.1
    assert b["kid"] == runs[0]["curve"][-1]["kid"]  # the other metrics stay
    step_flops = runner.executed_step_flops(cfg)  # the FLOP cost is recounted
    assert [p["flops"] for p in out["runs"][0]["curve"]] == [100 * step_flops, 200 * step_flops]
    assert "no speedup measurable" in (tmp_path / "speedup.md").read_text()  # the baseline gained nothing
    with pytest.raises(FileNotFoundError, match="results.json"):
        runner.rescore(tmp_path / "missing")


class _Crash(Exception):
    pass


def test_a_benchmark_run_is_a_resumable_trainer_run(tmp_path):
    """train_run is the trainer with the evaluation hook: a run killed after an evaluation but before the checkpoint
    of that step resumes from the previous checkpoint, evaluates that step again on the same weights, and ends with
    the curve of an uninterrupted run; its training clock carries over and excludes evaluation."""
    size = dataclasses.replace(_size("cpu"), steps=6, evals=3)
    tiny = ("model.width=32", "model.depth=3", "model.heads=2", "text.width=32", "data.image_size=16", "model.patch=4",
            "train.global_batch=8", "data.worker_threads=0", "sample.steps=2")  # fmt: skip
    cfg = protocol.build_config(size, "pixel", 0, tiny)
    kwargs = {"feature_spec": None}
    t0 = time.perf_counter()
    straight = runner.train_run(cfg, tmp_path / "straight", 2, 8, 4321, kwargs, n_final=12)
    elapsed = time.perf_counter() - t0

    def crash_at_4(point):
        if point["step"] == 4:
            raise _Crash

    with pytest.raises(_Crash):
        runner.train_run(cfg, tmp_path / "split", 2, 8, 4321, kwargs, on_eval=crash_at_4, n_final=12)
    split = runner.train_run(cfg, tmp_path / "split", 2, 8, 4321, kwargs, n_final=12)
    assert [p["step"] for p in split["curve"]] == [p["step"] for p in straight["curve"]] == [2, 4, 6]
    for a, b in zip(straight["curve"], split["curve"], strict=True):
        for k in ("align_overall", "vloss", "train_loss", "samples", "flops"):
            assert a[k] == b[k], (k, a[k], b[k])
    assert "final_align_overall" in split["curve"][-1] and "final_align_overall" not in split["curve"][0]
    # the controls are scored once, on the n_eval captions, not again at the final evaluation
    assert "ctrl_shuffled_align_overall" in split["curve"][-1]
    assert not any(k.startswith("final_ctrl_") for k in split["curve"][-1])
    walls = [p["wall_s"] for p in split["curve"]]
    assert 0 < walls[0] < walls[1] < walls[2]
    # The clock excludes compilation and the evaluations.
    evals = sum(p["eval_s"] for p in straight["curve"])
    assert straight["curve"][-1]["wall_s"] < elapsed - evals - straight["compile_s"]
    assert straight["diverged"] is None and straight["step_flops"] > 0
    # the FLOP cost is the trainer's own count of its compiled step, the one a rescore recounts from the config
    assert straight["step_flops"] == split["step_flops"] == runner.executed_step_flops(cfg)


def test_evaluating_and_checkpointing_during_a_run_leave_its_training_unchanged(tmp_path):
    """A headline run (evaluated and checkpointed every few steps) and a sweep run (evaluated once, at the end)
    of one config and seed train the same weights: the end's training loss, v-loss and alignment are equal."""
    tiny = ("model.width=32", "model.depth=3", "model.heads=2", "text.width=32", "data.image_size=16", "model.patch=4",
            "train.global_batch=8", "data.worker_threads=0", "sample.steps=2")  # fmt: skip
    ends = []
    for evals in (4, 1):
        size = dataclasses.replace(_size("cpu"), steps=8, evals=evals)
        cfg = protocol.build_config(size, "pixel", 0, tiny)
        assert cfg.train.ckpt_every == 8 // evals
        rec = runner.train_run(cfg, tmp_path / f"e{evals}", 8 // evals, 8, 4321, {"feature_spec": None}, n_final=8)
        assert len(rec["curve"]) == evals
        ends.append(rec["curve"][-1])
    for k in ("train_loss", "vloss", "align_overall", "align_exact"):
        assert ends[0][k] == ends[1][k], k


def test_a_signalled_run_writes_no_record_and_the_rerun_resumes_it(tmp_path):
    """A benchmark run stopped by SIGTERM (the trainer checkpoints and returns) raises RunStopped and leaves no run
    record, so the next benchmark command resumes it instead of reusing a short curve; a record with a short curve
    (written by older versions) is trained on too, and the finished record is reused."""
    size = dataclasses.replace(_size("cpu"), steps=4, evals=2, n_eval=8, n_final=8)
    tiny = ("model.width=32", "model.depth=3", "model.heads=2", "text.width=32", "data.image_size=16", "model.patch=4",
            "train.global_batch=8", "data.worker_threads=0", "sample.steps=2")  # fmt: skip
    lines = []

    def log(line):
        lines.append(line)
        if "step     2" in line and not any("reused" in x for x in lines):
            os.kill(os.getpid(), signal.SIGTERM)

    bench = runner.Runner(size, tmp_path, tiny, evaluator_kwargs={"feature_spec": None}, log=log)
    with pytest.raises(runner.RunStopped, match="stopped at step"):
        bench.run("pixel", 0)
    assert not list((tmp_path / "runs").glob("*.json"))
    rec = bench.run("pixel", 0)
    [record] = (tmp_path / "runs").glob("*.json")
    assert [p["step"] for p in rec["curve"]] == [2, 4]
    short = dict(rec, curve=rec["curve"][:1])
    assert runner.complete(rec, 4) and not runner.complete(short, 4)
    assert bench.run("pixel", 0)["curve"] == rec["curve"] and lines[-1].endswith(f"reused from {record}")


def test_an_archive_of_run_records_resumes_a_study_elsewhere(tmp_path, monkeypatch):
    """Finished runs' records are copied to the archive (a directory kept apart from --out, e.g. in git): another
    output directory (another machine, a later session) reuses them without training; a sweep run's record holds
    its final weights' alignment at every guidance scale of the size, so the sweep's guidance choice needs no
    weights either."""
    tiny = ("model.width=32", "model.depth=3", "model.heads=2", "text.width=32", "data.image_size=16", "model.patch=4",
            "train.global_batch=8", "data.worker_threads=0", "sample.steps=2")  # fmt: skip
    frozen = protocol.build_config(_size("cpu"), "pixel", 0, tiny).sample.cfg_scale
    size = dataclasses.replace(_size("cpu"), steps=4, evals=2, n_eval=8, n_final=8, cfg_scales=(frozen, 9.0))
    archive = tmp_path / "archive"
    kwargs = {"evaluator_kwargs": {"feature_spec": None}, "log": lambda s: None, "archive": archive}
    first = runner.Runner(size, tmp_path / "here", tiny, **kwargs)
    rec = first.run("pixel", 0, 2e-3, evals=1, tuning=True)
    key = runner._run_key(size, "pixel", 0, tiny, 2e-3) + "-e1"
    assert sorted(p.name for p in archive.iterdir()) == [f"{key}.json"]  # the record only: no weights, no images
    assert set(rec["cfg_scores"]) == {f"{frozen:g}", "9"} and all(0 <= v <= 1 for v in rec["cfg_scores"].values())
    # at the run's own scale: the same weights, captions and noise as its final evaluation, so the same score
    assert rec["cfg_scores"][f"{frozen:g}"] == rec["curve"][-1]["align_overall"]
    # evaluated at the end only, a sweep run still checkpoints at the size's evaluation cadence (a stop loses little)
    assert json.loads(rec["config"])["train"]["ckpt_every"] == size.eval_every == 2 < size.steps

    def no_training(*a, **kw):
        raise AssertionError("trained a run the archive holds")

    monkeypatch.setattr(runner, "train_run", no_training)
    lines = []
    elsewhere = runner.Runner(size, tmp_path / "elsewhere", tiny, **dict(kwargs, log=lines.append))
    again = elsewhere.run("pixel", 0, 2e-3, evals=1, tuning=True)
    assert again["curve"] == rec["curve"] and again["cfg_scores"] == rec["cfg_scores"] and again["reused"]
    assert lines[-1].endswith(f"reused from {archive / (key + '.json')}")
    assert (tmp_path / "elsewhere" / "runs" / f"{key}.json").exists()
    with pytest.raises(AssertionError, match="trained a run"):  # another rate is another run
        elsewhere.run("pixel", 0, 4e-3, evals=1, tuning=True)
    # Another guidance scale frozen since (the size file's): a sweep record scored at that scale is still the run's
    # (training never reads the scale) and the sweep reads its score there; a scale it was not scored at is another
    # config, refused before training (a retrained run would overwrite the record).
    build = runner.build_config

    def frozen_at(scale):
        def build_config(*a, **kw):
            cfg = build(*a, **kw)
            runner.config_lib.apply_override(cfg, f"sample.cfg_scale={scale!r}")
            return cfg

        return build_config

    monkeypatch.setattr(runner, "build_config", frozen_at(9.0))
    later = runner.Runner(size, tmp_path / "later", tiny, **kwargs).run("pixel", 0, 2e-3, evals=1, tuning=True)
    assert later["reused"] and sweeps.sweep_score(later, 9.0) == rec["cfg_scores"]["9"]
    assert sweeps.sweep_score(later, frozen) == rec["curve"][-1]["align_overall"]
    monkeypatch.setattr(runner, "build_config", frozen_at(7.0))
    kept = (archive / f"{key}.json").read_text()
    with pytest.raises(runner.RunConflict, match="another --archive"):
        runner.Runner(size, tmp_path / "later2", tiny, **kwargs).run("pixel", 0, 2e-3, evals=1, tuning=True)
    assert (archive / f"{key}.json").read_text() == kept
    monkeypatch.setattr(runner, "build_config", build)
    # The size file changed under a kept name (e.g. its data): refused before training, the record left as it was.
    changed = json.loads((archive / f"{key}.json").read_text())
    changed["config"] = changed["config"].replace('"render": "fixed"', '"render": "jitter"')
    assert changed["config"] != rec["config"]
    (archive / f"{key}.json").write_text(json.dumps(changed))
    kept = (archive / f"{key}.json").read_text()
    with pytest.raises(runner.RunConflict, match="another --archive"):
        runner.Runner(size, tmp_path / "third", tiny, **kwargs).run("pixel", 0, 2e-3, evals=1, tuning=True)
    assert (archive / f"{key}.json").read_text() == kept


def test_a_run_of_the_same_config_under_another_name_is_not_trained_again(tmp_path, monkeypatch):
    """A Muon arm's grid of Muon's rate (AdamW's pinned at its winner) passes through the point its AdamW sweep ran
    (Muon at its frozen rate there): that record is reused and saved under the new name. A record of another kind
    (a sweep's for a headline run) or another config is not."""
    size = dataclasses.replace(_size("cpu"), steps=4, evals=2, n_eval=8, n_final=8)
    frozen = protocol.build_config(size, "prx", 100)
    lr, muon_lr = frozen.optim.lr, frozen.optim.muon_lr
    archive = tmp_path / "archive"
    archive.mkdir()
    swept = runner._run_key(size, "prx", 100, (), lr, "lr") + "-e1"  # the AdamW sweep's point at the winner
    record = {"method": "prx", "seed": 100, "curve": _curve([0.7], every=4), "cfg_scores": {"1.5": 0.7},
              "config": runner.config_lib.to_json(protocol.build_config(size, "prx", 100, (), lr, "lr"))}  # fmt: skip
    (archive / f"{swept}.json").write_text(json.dumps(record))

    def no_training(*a, **kw):
        raise AssertionError("trained a run the archive holds")

    monkeypatch.setattr(runner, "train_run", no_training)
    lines = []
    pinned = (f"optim.lr={lr!r}",)
    grid = runner.Runner(size, tmp_path / "out", pinned, archive=archive, log=lines.append)
    got = grid.run("prx", 100, muon_lr, evals=1, rate="muon_lr", tuning=True)
    assert got["curve"] == record["curve"] and got["reused"]
    assert lines[-1].endswith(f"reused from {archive / (swept + '.json')}: the same config")
    key = runner._run_key(size, "prx", 100, pinned, muon_lr, "muon_lr") + "-e1"
    assert json.loads((archive / f"{key}.json").read_text()) == record  # found by its own name from now on
    with pytest.raises(AssertionError, match="trained a run"):  # another Muon rate is another run
        grid.run("prx", 100, 2 * muon_lr, evals=1, rate="muon_lr", tuning=True)
    with pytest.raises(AssertionError, match="trained a run"):  # a headline run is evaluated otherwise
        runner.Runner(size, tmp_path / "head", archive=archive, log=lines.append).run("prx", 100)


def test_the_archive_keeps_the_autoencoder_its_records_used(tmp_path):
    """Baseline A's autoencoder is copied into the archive beside the records, and from there into another
    machine's cache instead of being trained again (a retrained one differs across CPUs); a pixel run has none."""
    from reve_jax.latent import training as latent_training

    size = _size("cpu30")
    latent_cfg, pixel_cfg = (protocol.build_config(size, m, 0) for m in ("latent", "recipe"))
    archive = tmp_path / "archive"
    here = runner.Runner(size, tmp_path / "here", archive=archive, log=lambda s: None)
    trained = latent_training.cache_path(latent_cfg, here.cache_dir)
    trained.parent.mkdir(parents=True)
    trained.write_bytes(b"weights")
    here._share_autoencoder(latent_cfg, into_cache=True)  # already in the cache: nothing taken, nothing written
    assert not archive.exists()
    here._share_autoencoder(latent_cfg, into_cache=False)
    assert [p.name for p in archive.iterdir()] == [trained.name] and (archive / trained.name).read_bytes() == b"weights"
    there = runner.Runner(size, tmp_path / "there", archive=archive, log=lambda s: None)
    there._share_autoencoder(latent_cfg, into_cache=True)
    assert latent_training.cache_path(latent_cfg, there.cache_dir).read_bytes() == b"weights"
    (archive / trained.name).write_bytes(b"other")  # a copy never overwrites a file already there
    there._share_autoencoder(latent_cfg, into_cache=True)
    assert latent_training.cache_path(latent_cfg, there.cache_dir).read_bytes() == b"weights"
    there._share_autoencoder(pixel_cfg, into_cache=False)
    assert [p.name for p in archive.iterdir()] == [trained.name]


def test_a_stopped_autoencoder_training_resumes_from_the_archive(tmp_path):
    """The partial state of an autoencoder training, copied into the archive, is taken into a new machine's cache
    that has neither the weights nor a partial state of its own; never over a partial state already there, and not
    once the weights exist (in the cache or the archive)."""
    from reve_jax.latent import training as latent_training

    size = _size("cpu30")
    cfg = protocol.build_config(size, "latent", 0)
    archive = tmp_path / "archive"
    archive.mkdir()
    elsewhere = latent_training.cache_path(cfg, tmp_path / "elsewhere")
    weights_name, partial_name = elsewhere.name, latent_training.partial_path(elsewhere).name
    (archive / partial_name).write_bytes(b"step 9000")
    new = runner.Runner(size, tmp_path / "new", archive=archive, log=lambda s: None)
    new._share_autoencoder(cfg, into_cache=True)
    cached = latent_training.cache_path(cfg, new.cache_dir)
    assert latent_training.partial_path(cached).read_bytes() == b"step 9000" and not cached.exists()
    (archive / partial_name).write_bytes(b"step 9500")  # the cache's own partial state is never overwritten
    new._share_autoencoder(cfg, into_cache=True)
    assert latent_training.partial_path(cached).read_bytes() == b"step 9000"
    done = runner.Runner(size, tmp_path / "done", archive=archive, log=lambda s: None)
    (archive / weights_name).write_bytes(b"weights")  # finished: the weights are taken, the partial state is not
    done._share_autoencoder(cfg, into_cache=True)
    got = latent_training.cache_path(cfg, done.cache_dir)
    assert got.read_bytes() == b"weights" and not latent_training.partial_path(got).exists()


def _newton_schulz_flops(shape, steps):
    """Per orthogonalisation of a (rows, cols) matrix with m = min, n = max: X X^T (2 m^2 n), its square (2 m^3)
    and the product with X (2 m^2 n) at every iteration."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m**3)


def test_executed_flops_count_the_step_beyond_the_models_matmuls():
    """The benchmark's FLOP cost is XLA's count of the whole step. For a plain AdamW DiT it is the model's matmuls
    (the analytic count) plus some elementwise work; switching the hidden weights to Muon adds what its
    Newton-Schulz iterations cost per step, counted here by hand from the shapes Muon takes, which the analytic
    model count (the same for both) does not see."""
    from reve_jax import flops
    from reve_jax.train import builder

    tiny = ("model.width=32", "model.depth=3", "model.heads=2", "text.width=32", "data.image_size=16", "model.patch=4",
            "train.global_batch=8", "data.worker_threads=0")  # fmt: skip
    size = _size("cpu")
    adamw_cfg = protocol.build_config(size, "pixel", 0, tiny)
    muon_cfg = protocol.build_config(size, "pixel", 0, (*tiny, "optim.name='muon'"))
    model = flops.train_flops_per_image(adamw_cfg) * 8
    assert flops.train_flops_per_image(muon_cfg) * 8 == model
    adamw = runner.executed_step_flops(adamw_cfg)
    assert model < adamw < 1.25 * model, (adamw, model)
    setup = builder.build(muon_cfg).setup
    params = setup.abstract_state["params"]
    shapes = [
        p.shape
        for p, label in zip(jax.tree.leaves(params), jax.tree.leaves(setup.param_labels), strict=True)
        if label == "muon"
    ]
    assert shapes, "the test needs weights that Muon takes"
    ns = sum(_newton_schulz_flops(s, muon_cfg.optim.muon_ns_steps) for s in shapes)
    added = runner.executed_step_flops(muon_cfg) - adamw
    assert 0.95 * ns < added < 1.1 * ns, (added, ns)
    rec = runner.count_flops({"curve": [{"step": 2}, {"step": 6}]}, adamw)
    assert [p["flops"] for p in rec["curve"]] == [2 * adamw, 6 * adamw] and rec["step_flops"] == adamw


def test_sweep_extends_the_grid_until_the_winner_is_inside_then_picks_the_guidance(tmp_path, monkeypatch):
    """The sweep's logic on stub runs: alignment peaks at lr 1.6e-2, beyond the size's grid, so the grid is
    extended upward twice; the winner is inside the final grid; the guidance scale comes back as a number."""
    size = dataclasses.replace(_size("cpu"), sweep_lrs=(1e-3, 2e-3, 4e-3), cfg_scales=(1.5, 2.0, 3.0))
    trained = []

    def fake_run(self, method, seed, lr=None, *, evals=None, rate="lr", tuning=False):
        trained.append((method, seed, lr, evals, rate))
        score = 1.0 - abs(np.log2(lr / 1.6e-2)) / 10
        return {"curve": [{"align_overall": score}], "cfg_scores": {"1.5": 0.5, "2": 0.7, "3": 0.6}}

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    logs = []
    result = sweeps.sweep(size, tmp_path, ["latent"], max_extend=3, log=logs.append)
    lrs = [t[2] for t in trained]
    # every rate on each of the size's tuning seeds (never a headline seed), a rate's score their mean
    assert lrs == [lr for lr in (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2) for _ in size.tune_seeds]
    assert {t[1] for t in trained} == set(size.tune_seeds) and not set(size.tune_seeds) & set(size.seeds)
    assert all(t[3] == 1 for t in trained)  # sweep runs are evaluated at the end only
    assert result["latent"]["lr"] == 1.6e-2 and result["latent"]["inside_grid"]
    assert result["latent"]["cfg_scale"] == 2.0 and isinstance(result["latent"]["cfg_scale"], float)
    assert json.loads((tmp_path / "sweep.json").read_text())["latent"]["cfg_scale"] == 2.0
    assert "inside" in logs[-1] and "guidance 2" in logs[-1]
    # Muon's rate swept apart: the runs vary it, and its result joins sweep.json beside the main rate's
    trained.clear()
    result = sweeps.sweep(size, tmp_path, ["prx"], max_extend=3, rate="muon_lr", log=logs.append)
    assert {t[4] for t in trained} == {"muon_lr"} and result["prx"]["muon_lr"] == 1.6e-2
    assert set(json.loads((tmp_path / "sweep.json").read_text())) == {"latent", "prx@muon_lr"}


def test_a_sweep_around_the_frozen_rates_spans_each_method_alike(tmp_path, monkeypatch):
    """`sweep_around=1`: each method's grid is its frozen rate and the rates a factor of 2 either side (its own prior,
    the same span for every method), extended like any grid while the winner sits at an edge; a grid given by hand
    (`--grid`) replaces the span."""
    size = dataclasses.replace(_size("cpu"), sweep_around=1, cfg_scales=(1.5, 3.0))
    peak = {"latent": None, "recipe": None}
    tried = {m: [] for m in peak}

    def run(self, method, seed, lr=None, rate="lr", **kw):
        tried[method].append(lr)
        score = 1.0 - abs(np.log2(lr / peak[method])) / 10
        return {"curve": [{"align_overall": score}], "cfg_scores": {"1.5": score, "3": score - 0.1}}

    monkeypatch.setattr(runner.Runner, "run", run)
    frozen = {m: protocol.build_config(size, m, 0).optim.lr for m in peak}
    assert frozen["latent"] != frozen["recipe"], "the test needs two methods with different frozen rates"
    peak["latent"], peak["recipe"] = frozen["latent"], 4 * frozen["recipe"]  # one inside the span, one above it
    result = sweeps.sweep(size, tmp_path, list(peak), seeds=(100,), log=lambda s: None)
    w = frozen["latent"]
    assert tried["latent"] == [w / 2, w, 2 * w] and result["latent"]["lr"] == w and result["latent"]["inside_grid"]
    w = frozen["recipe"]
    assert tried["recipe"] == [w / 2, w, 2 * w, 4 * w, 8 * w] and result["recipe"]["lr"] == 4 * w
    assert size.sweep_grid(1e-3) == [5e-4, 1e-3, 2e-3]
    assert dataclasses.replace(size, sweep_around=0).sweep_grid(1e-3) == sorted(size.sweep_lrs)


def test_the_sweep_dry_run_names_the_span_or_the_grid_given_by_hand(monkeypatch, capsys):
    from reve_jax.speedup import cli

    load = protocol.load_protocol
    monkeypatch.setattr(protocol, "load_protocol", lambda path: dataclasses.replace(load(path), sweep_around=1))
    for argv, says in (
        ([], "x2^-1..x2^1 around each method's frozen rate"),
        (["--grid", "1e-3,2e-3"], "[0.001, 0.002]"),
    ):
        with pytest.raises(SystemExit) as done:
            cli.main(["--size", "cpu30", "--sweep", "--methods", "latent,recipe", "--dry-run", *argv])
        assert done.value.code == 0 and f"sweep every rate {says} and guidance" in capsys.readouterr().out


def test_a_muon_arms_sweeps_hold_the_rate_they_began_with_and_reach_it(tmp_path, monkeypatch):
    """`sweep_from`: the AdamW group's sweep holds Muon's rate at the value recorded there, whatever is frozen since
    (freezing the winners changes none of its runs); Muon's grid reaches that value in factors of 2, so the point the
    AdamW sweep measured is not dropped by a local winner below it (the stub's scores dip at 4e-3, then peak there)."""
    held = 1.6e-2
    size = dataclasses.replace(_size("cpu"), sweep_lrs=(1e-3, 2e-3, 4e-3), sweep_from={"prx": {"muon_lr": held}})
    frozen = protocol.build_config(size, "prx", 0)
    assert frozen.optim.muon_lr != held, "the test needs a frozen Muon rate other than the held one"
    swept = protocol.build_config(size, "prx", 0, (), 2e-3, "lr")
    assert (swept.optim.lr, swept.optim.muon_lr) == (2e-3, held)
    muon = protocol.build_config(size, "prx", 0, ("optim.lr=0.002",), 4e-3, "muon_lr")
    assert (muon.optim.lr, muon.optim.muon_lr) == (2e-3, 4e-3)
    scores = {1e-3: 0.6, 2e-3: 0.7, 4e-3: 0.65, 8e-3: 0.75, 1.6e-2: 0.8, 3.2e-2: 0.7}
    tried = []

    def run(self, method, seed, lr=None, rate="lr", **kw):
        tried.append(lr)
        return {"curve": [{"align_overall": scores[lr]}], "cfg_scores": {f"{frozen.sample.cfg_scale:g}": scores[lr]}}

    monkeypatch.setattr(runner.Runner, "run", run)
    result = sweeps.sweep(size, tmp_path, ["prx"], rate="muon_lr", seeds=(100,), log=lambda s: None)["prx"]
    assert sorted(set(tried)) == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]  # reaches 1.6e-2, then one past it
    assert result["muon_lr"] == held and result["inside_grid"]
    plain = sweeps.sweep(dataclasses.replace(size, sweep_from={}), tmp_path / "plain", ["prx"], rate="muon_lr",
                         seeds=(100,), log=lambda s: None)["prx"]  # fmt: skip
    assert plain["muon_lr"] == 2e-3  # without it the local winner stands


def test_a_sweep_over_two_seeds_scores_each_rate_by_its_mean(tmp_path, monkeypatch):
    """On one seed a rate next to the divergence cliff wins by a little; on the other it stalls. Scored on the mean
    over both seeds the sweep picks the rate that holds on both, runs every rate on every seed, and averages the
    guidance scores."""
    size = dataclasses.replace(_size("cpu"), sweep_lrs=(1e-3, 2e-3, 4e-3, 8e-3), cfg_scales=(1.5, 3.0))
    finals = {
        0: {1e-3: 0.50, 2e-3: 0.82, 4e-3: 0.83, 8e-3: 0.84, 1.6e-2: 0.40},
        1: {1e-3: 0.60, 2e-3: 0.80, 4e-3: 0.55, 8e-3: 0.45},
    }
    trained = []

    guidance = {0: {"1.5": 0.7, "3": 0.9}, 1: {"1.5": 0.8, "3": 0.4}}

    def fake_run(self, method, seed, lr=None, *, evals=None, rate="lr", tuning=False):
        trained.append((seed, lr))
        return {"curve": [{"align_overall": finals[seed][lr]}], "cfg_scores": guidance[seed]}

    monkeypatch.setattr(runner.Runner, "run", fake_run)
    one = sweeps.sweep(size, tmp_path / "one", ["latent"], seeds=(0,), log=lambda s: None)
    assert one["latent"]["lr"] == 8e-3 and one["latent"]["inside_grid"] and {s for s, _ in trained} == {0}
    trained.clear()
    two = sweeps.sweep(size, tmp_path / "two", ["latent"], seeds=(0, 1), log=lambda s: None)["latent"]
    assert two["lr"] == 2e-3 and two["inside_grid"] and two["seeds"] == [0, 1]
    assert sorted(trained) == sorted((s, lr) for s in (0, 1) for lr in size.sweep_lrs)
    assert two["grid"]["0.002"] == pytest.approx(0.81) and two["per_seed"][1]["0.008"] == 0.45
    assert two["cfg_scores"] == pytest.approx({"1.5": 0.75, "3": 0.65}) and two["cfg_scale"] == 1.5
    # sweep.md: every run of the sweep in one table, the winners in bold
    md = (tmp_path / "two" / "sweep.md").read_text().splitlines()
    assert md[0] == "| method | rate | value | seed 0 | seed 1 | mean | runs |"
    # the rates' row names the scale they were last scored at: 1.5, the winner's best, not cpu's frozen 3 (the
    # stub's score is the same at every scale, so re-scoring there leaves the rates as they were)
    assert two["rescored"] == [3.0] and two["scored_at"] == 1.5
    assert "| latent | lr (at guidance 1.5) | 0.001 | 0.500 | 0.600 | 0.550 | 8 |" in md
    assert "| latent | lr (at guidance 1.5) | **0.002** | 0.820 | 0.800 | **0.810** |  |" in md
    assert "| latent | guidance (at lr 0.002) | 1.5 |  |  | **0.750** |  |" in md


def test_a_sweep_keeps_the_frozen_rate_and_guidance_on_an_exact_tie(tmp_path, monkeypatch):
    """Two settings that score exactly alike cannot be told apart: the sweep keeps the size's frozen one (the PRX
    variant's 1e-3 and guidance 1.5 on `cpu`) rather than the first listed; without a tie the best still wins, and
    a tie between settings that are not frozen goes to the first listed."""
    size = dataclasses.replace(_size("cpu"), sweep_lrs=(5e-4, 1e-3, 2e-3), cfg_scales=(1.0, 1.5, 2.0))
    frozen = protocol.build_config(size, "prx", 0)
    assert (frozen.optim.lr, frozen.sample.cfg_scale) == (1e-3, 1.5), "the test assumes cpu's frozen PRX values"
    finals = {5e-4: 0.8, 1e-3: 0.8, 2e-3: 0.7}
    scales = {"1": 0.85, "1.5": 0.85, "2": 0.6}
    monkeypatch.setattr(
        runner.Runner,
        "run",
        lambda self, m, s, lr=None, **k: {"curve": [{"align_overall": finals[lr]}], "cfg_scores": scales},
    )
    result = sweeps.sweep(size, tmp_path / "tie", ["prx"], log=lambda s: None)["prx"]
    assert result["lr"] == 1e-3 and result["inside_grid"] and result["cfg_scale"] == 1.5
    finals[5e-4] = 0.81  # no longer a tie: the better rate wins (at the grid's edge, so the grid grows below it)
    finals[2.5e-4] = 0.5
    assert sweeps.sweep(size, tmp_path / "best", ["prx"], log=lambda s: None)["prx"]["lr"] == 5e-4
    assert sweeps.pick({"1": 0.5, "2": 0.5, "3": 0.4}, "3") == "1"


def test_a_sweep_whose_guidance_moves_re_scores_its_rates_there_until_it_stands(tmp_path, monkeypatch):
    """cpu64's recipe (2026-12-07): scored at the frozen guidance the grid's winner is 2e-3, whose best guidance is
    1; re-scored at guidance 1 from the same runs the winner is 4e-3, at the grid's edge, so the grid grows to 8e-3
    (one run per seed trained, no other trained again); at 4e-3 guidance 1 is best again, and the sweep stops there."""
    size = dataclasses.replace(_size("cpu"), sweep_lrs=(1e-3, 2e-3, 4e-3))
    f = protocol.build_config(size, "latent", 0).sample.cfg_scale
    assert f != 1.0, "the test needs a frozen guidance other than 1"
    at_f = {1e-3: 0.5, 2e-3: 0.6, 4e-3: 0.55, 8e-3: 0.4}
    at_1 = {1e-3: 0.6, 2e-3: 0.7, 4e-3: 0.8, 8e-3: 0.75}
    trained = []

    def run(self, method, seed, lr=None, rate="lr", **kw):
        trained.append((seed, lr))
        return {"cfg_scale": f, "curve": [{"align_overall": at_f[lr]}],
                "cfg_scores": {f"{f:g}": at_f[lr], "1": at_1[lr]}}  # fmt: skip

    monkeypatch.setattr(runner.Runner, "run", run)
    logs = []
    r = sweeps.sweep(size, tmp_path, ["latent"], log=logs.append)["latent"]
    assert sorted(trained) == sorted((s, lr) for s in size.tune_seeds for lr in at_f)  # each run trained once
    assert (r["lr"], r["cfg_scale"], r["scored_at"], r["rescored"]) == (4e-3, 1.0, 1.0, [f]) and r["inside_grid"]
    assert r["grid"] == pytest.approx({f"{k:g}": v for k, v in at_1.items()})
    assert any(f"guidance 1 beats {f:g}" in line for line in logs)
    assert "| latent | lr (at guidance 1) | **0.004** |" in (tmp_path / "sweep.md").read_text()
    # without the move (guidance f best on the winner) the first pass stands
    at_1[2e-3] = 0.59
    trained.clear()
    r = sweeps.sweep(size, tmp_path / "stays", ["latent"], log=lambda s: None)["latent"]
    assert (r["lr"], r["cfg_scale"], r["rescored"]) == (2e-3, f, []) and 8e-3 not in {lr for _, lr in trained}


def test_a_finished_run_is_reused_across_added_config_keys():
    """A run saved before a key was added to the config (config.ADDED_KEYS) still matches its config, read at the
    value it ran under; a real difference in any value does not match."""
    from reve_jax import config as config_lib

    cfg = protocol.build_config(_size("cpu"), "recipe", 0)
    saved = json.loads(config_lib.to_json(cfg))
    del saved["loss"]["dino_target"]  # a run from before the key existed
    old = json.dumps(saved, sort_keys=True)
    assert old != config_lib.to_json(cfg) and protocol.same_config(old, cfg)
    assert not protocol.same_config(old.replace('"dino_weight": 0.0', '"dino_weight": 0.5'), cfg)
    saved["loss"]["dino_target"] = "features"  # a value other than the one ADDED_KEYS says old runs had
    assert not protocol.same_config(json.dumps(saved, sort_keys=True), cfg)
    assert not protocol.same_config(None, cfg)
    # the checkpoint cadence changes no result (a resumed run ends as a straight one), the budget does
    saved = json.loads(config_lib.to_json(cfg))
    saved["train"]["ckpt_every"] += 7
    assert protocol.same_config(json.dumps(saved), cfg)
    saved["train"]["steps"] += 7
    assert not protocol.same_config(json.dumps(saved), cfg)
    # a latent run's autoencoder is matched by its file name (its settings' hash), wherever the cache directory is
    latent = protocol.build_config(_size("cpu"), "latent", 0)
    runner.config_lib.apply_override(latent, "latent.path='/machine_a/cache/autoencoder_0123456789ab.npz'")
    moved = latent.to_json().replace("/machine_a/cache/", "runs/s30/cache/")
    assert moved != latent.to_json() and protocol.same_config(moved, latent)
    assert not protocol.same_config(moved.replace("0123456789ab", "ba9876543210"), latent)
    # Muon's settings do not count for a run that trains with AdamW; for a Muon run they do
    saved = json.loads(config_lib.to_json(cfg))
    saved["optim"]["muon_lr"] = 0.123
    assert cfg.optim.name == "adamw" and protocol.same_config(json.dumps(saved), cfg)
    saved["optim"]["lr"] = 0.123
    assert not protocol.same_config(json.dumps(saved), cfg)
    prx = protocol.build_config(_size("cpu"), "prx", 0)
    saved = json.loads(config_lib.to_json(prx))
    saved["optim"]["muon_lr"] = 0.123
    assert prx.optim.name == "muon" and not protocol.same_config(json.dumps(saved), prx)
    # the sampler's clamp: a run from before sample.t_eps sampled with training's (-1), which counts for an
    # x-predicting method and not for a v-predicting one (baseline A's images do not depend on it)
    for method, reused in (("recipe", False), ("latent", True)):
        cfg = protocol.build_config(_size("cpu"), method, 0)
        saved = json.loads(config_lib.to_json(cfg))
        del saved["sample"]["t_eps"]
        assert cfg.sample.t_eps == 0.0 and protocol.same_config(json.dumps(saved), cfg) is reused, method

"""scripts/evaluate.py on a run trained a few steps by scripts/train.py: the JSON holds every metric with its
interval, the floor and the controls, and per caption its checks; the PNG marks each caption's checks."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from util import TINY, load_script

from reve_jax.data.synthetic import alignment, controls
from reve_jax.metrics import regions

REPO = Path(__file__).resolve().parents[1]


def test_evaluate_scores_a_trained_run(tmp_path):
    workdir = tmp_path / "run"
    train = ["--config", str(REPO / "configs" / "tiny.py"), "--workdir", str(workdir)]
    load_script("train").main([*train, *(f"--config.{o}" for o in TINY), "--config.train.steps=2"])
    load_script("evaluate").main(["--workdir", str(workdir), "--n", "16", "--boot", "50"])
    result = json.loads((workdir / "evaluation" / "step_2.json").read_text())
    # Both caption sets, each named: unseen compositions (the headline) and seen ones.
    assert list(result["splits"]) == ["unseen", "seen"] and result["heldout_compositions"].startswith("held out:")
    unseen, seen = result["splits"]["unseen"], result["splits"]["seen"]
    assert (result["step"], result["n"], len(unseen["captions"]), len(seen["captions"])) == (2, 16, 16, 16)
    assert {r["caption"] for r in unseen["captions"]}.isdisjoint({r["caption"] for r in seen["captions"]})
    m = unseen["metrics"]
    for name in (*(f"align_{a}" for a in (*alignment.ATTRIBUTES, "overall", "exact")), "kid", "kid_image"):
        assert m[f"{name}_lo"] <= m[name] <= m[name + "_hi"], name
    assert {"kid_floor", "kid_floor_lo", "kid_floor_hi", "vloss", "fd_shapes"} <= set(m)
    for name in controls.NAMES:
        assert f"ctrl_{name}_align_overall" in m and f"ctrl_{name}_kid" in m
    assert m["ctrl_real_align_overall"] >= 0.99 > m["ctrl_shuffled_align_overall"]
    # Per caption, the checks behind the scores: they add up to them.
    rows = unseen["captions"]
    assert rows[0]["caption"].endswith("background") and set(rows[0]["checks"]) == set(alignment.ATTRIBUTES)
    for a in alignment.ATTRIBUTES:
        passed, total = np.sum([r["checks"][a] for r in rows], axis=0)
        assert m[f"align_{a}"] == passed / total
    # The groups: every unseen caption holds a held-out pair, each counted once by kind and once by size, and
    # the groups' exact scores add up to the split's.
    kinds = {g: v for g, v in unseen["groups"].items() if g.startswith("held-out")}
    sizes = {g: v for g, v in unseen["groups"].items() if g in ("small", "large", "mixed")}
    assert kinds and sizes and set(unseen["groups"]) == set(kinds) | set(sizes)
    for part in (kinds, sizes):
        assert sum(v["n"] for v in part.values()) == 16
        assert sum(v["n"] * v["align_exact"] for v in part.values()) == pytest.approx(16 * m["align_exact"])
    assert seen["groups"]["no held-out pair"]["n"] == 16 and not any(g.startswith("held-out") for g in seen["groups"])
    assert result["feature_net"]["test_accuracy"]["shape"] >= 0.95  # the checked-in net's held-out shape: 0.971
    png = Image.open(workdir / "evaluation" / "step_2.png")
    assert png.size[0] > 4 * 128 and png.size[1] > 4 * 128  # a 4 x 4 grid of 16 images, 128 px cells at least
    # An explicit step and output directory, with --regions: the KID with each region's real pixels given back
    # (tests/test_eval_regions.py checks what it finds).
    elsewhere = str(tmp_path / "elsewhere")
    load_script("evaluate").main(["--workdir", str(workdir), "--step", "2", "--n", "8", "--boot", "0",
                                  "--out", elsewhere, "--regions", "--splits", "unseen"])  # fmt: skip
    again = json.loads((tmp_path / "elsewhere" / "step_2.json").read_text())
    assert again["n"] == 8 and "align_overall_lo" not in again["splits"]["unseen"]["metrics"]
    table = again["regions"]
    assert table["generated"]["kid"] == pytest.approx(again["splits"]["unseen"]["metrics"]["kid"])  # the same 8 images
    assert sum(table[r]["frac"] for r in regions.REGIONS) == pytest.approx(1.0)
    # Another sampler, step count and clamp: the config in the JSON says how the images were drawn, the name too.
    sampler = {"euler": "heun", "heun": "euler"}[again["config"]["sample"]["sampler"]]
    load_script("evaluate").main(["--workdir", str(workdir), "--n", "8", "--boot", "0", "--out", elsewhere,
                                  "--sampler", sampler, "--steps", "3", "--t-eps", "-1",
                                  "--splits", "unseen"])  # fmt: skip
    other = json.loads((tmp_path / "elsewhere" / f"step_2_sampler{sampler}_steps3_t_eps-1.0.json").read_text())
    assert (other["config"]["sample"]["sampler"], other["config"]["sample"]["steps"]) == (sampler, 3)
    assert again["config"]["sample"]["t_eps"] == 0.0 and other["config"]["sample"]["t_eps"] == -1.0
    assert (
        again["config"]["sample"]["steps"] != 3
        and other["splits"]["unseen"]["metrics"]["kid"] != again["splits"]["unseen"]["metrics"]["kid"]
    )


def test_summary_line_prints_intervals_only_where_bootstrapped():
    from reve_jax.metrics.scoring import summary_line

    m = {f"align_{a}": 0.5 for a in (*alignment.ATTRIBUTES, "overall", "exact")}
    m |= {"kid": 0.05, "kid_floor": 0.001, "vloss": 0.1}
    assert "nan" not in summary_line(m) and "[" not in summary_line(m)  # --boot 0: values only
    m |= {"align_overall_lo": 0.4, "align_overall_hi": 0.6, "kid_lo": 0.04, "kid_hi": 0.06}
    line = summary_line(m)
    assert "align_overall 0.500 [0.400, 0.600]" in line and "kid 0.0500 [0.0400, 0.0600]" in line
    assert "align_shape 0.500  " in line and "nan" not in line


def test_grain_reads_pixel_noise_not_edges():
    """The grain diagnostic: 0 on the fixed rendering's scenes (flat backgrounds, sharp objects: a median ignores
    the edges), rising with added pixel noise of std s in [-1, 1] at about 1.75 s (the median |Laplacian| of white
    noise: 0.674 * sqrt(20) * s / 2 in [0, 1] units, less the uint8 rounding), unchanged by the image's colours."""
    from reve_jax.data.synthetic import SyntheticShapes
    from reve_jax.metrics import quality

    ds = SyntheticShapes(image_size=32, num_samples=64, render="fixed")  # the benchmark's rendering
    real = np.stack([ds[i]["image"] for i in range(64)]).astype(np.float32) / 127.5 - 1
    assert quality.grain(real) == 0.0
    rng = np.random.default_rng(0)
    for s in (0.02, 0.05):
        noisy = np.clip(real + s * rng.standard_normal(real.shape), -1, 1)
        assert 1.4 * s < quality.grain(noisy) < 2.0 * s, (s, quality.grain(noisy))
    assert quality.grain(-real) == 0.0

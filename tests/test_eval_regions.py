"""regions.py (scripts/evaluate.py --regions): the regions partition every image around its objects, and giving a
region back its real pixels finds a defect in the region that holds it, and only there."""

import numpy as np
import pytest
from flax import nnx
from util import tiny_config

from reve_jax import viz
from reve_jax.data import pipeline
from reve_jax.data.synthetic import controls
from reve_jax.metrics import quality, regions
from reve_jax.train import train_state


def _real_and_backgrounds(cfg, n):
    ds = pipeline.dataset_from_config(cfg.data)
    index = np.arange(n)
    return np.stack([ds[int(i)]["image"] for i in index]), controls.backgrounds(ds, index)


def test_the_regions_partition_each_image_around_its_objects():
    real, background = _real_and_backgrounds(tiny_config("data.image_size=32"), 24)
    m = regions.masks(real, background)
    assert tuple(m) == regions.REGIONS
    np.testing.assert_array_equal(sum(v.astype(int) for v in m.values()), 1)  # disjoint, and every pixel in one
    objects = np.any(real != background, axis=-1)
    np.testing.assert_array_equal(m["interior"] | m["rim"], objects)
    assert m["rim"].any(axis=(1, 2)).all() and m["interior"].any()  # every image has an object outline
    # the ring is background that touches the object (4-neighbourhood); `near` touches the ring, not the object
    pad = np.pad(objects, ((0, 0), (1, 1), (1, 1)))
    touches = pad[:, :-2, 1:-1] | pad[:, 2:, 1:-1] | pad[:, 1:-1, :-2] | pad[:, 1:-1, 2:]
    np.testing.assert_array_equal(m["ring"], touches & ~objects)
    assert not (m["near"] & touches).any() and not (m["flat"] & touches).any()
    assert (real[m["ring"]] == background[m["ring"]]).all()


def test_a_defect_on_the_objects_outline_is_found_in_the_rim():
    cfg = tiny_config("data.image_size=32")
    graphdef, _ = nnx.split(train_state.build_model(cfg))
    ev = quality.Evaluator(cfg, graphdef, 32, seed=0, n_boot=0, with_controls=False)  # the checked-in feature net
    real = viz.to_uint8(ev.heldout["image"])
    background = controls.backgrounds(ev.dataset, ev.heldout["index"])
    rim = regions.masks(real, background)["rim"]
    # each object loses its outline: a one-pixel erosion, its rim painted with the background
    eroded = np.where(rim[..., None], background, real)
    table = regions.by_region(ev, eroded)
    clean = ev.image_metrics(real, intervals=False)["kid"]
    assert table["generated"]["kid"] > clean + 0.003, (table, clean)  # 0.0065 when written
    assert table["rim"]["kid"] == pytest.approx(clean, abs=1e-9) and table["rim"]["align_overall"] == 1.0
    for name in ("interior", "ring", "near", "flat"):  # pixels that were right already: the images do not change
        assert table[name]["kid"] == table["generated"]["kid"] and table[name]["abs_err"] == 0.0, name
    assert table["rim"]["abs_err"] > 10 and sum(table[r]["frac"] for r in regions.REGIONS) == pytest.approx(1.0)
    assert "rim" in regions.format_table(table)
    jitter = quality.Evaluator(tiny_config("data.render='jitter'"), graphdef, 4, seed=0, n_boot=0, with_controls=False)
    with pytest.raises(ValueError, match="data.render='fixed'"):
        regions.by_region(jitter, real[:4])

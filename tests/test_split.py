"""The held-out compositions (data/synthetic/split.py): what the training stream never shows, what evaluation asks
for, and proof by enumeration that the README's run never reads a held-out composition."""

import numpy as np
import pytest

from reve_jax.config import load_config
from reve_jax.data import pipeline, synthetic, tokenizer
from reve_jax.data.synthetic import split
from reve_jax.metrics import vloss


def _held(cfg):
    return pipeline.heldout_compositions(cfg.data)


@pytest.mark.parametrize("spec", ["configs/tiny.py", "configs/speedup/cpu30.py", "configs/base.py"])
def test_the_split_holds_out_a_share_of_pairs_and_every_color_shape_and_cell_stays_seen(spec):
    cfg = load_config(spec, [])
    held = _held(cfg)
    colors = cfg.data.colors or synthetic.COLOR_NAMES
    shapes = cfg.data.shapes or synthetic.SHAPES
    cells = range(synthetic.GRID**2)
    assert len(held.color_shape) == round(0.15 * len(colors) * len(shapes))
    assert len(held.shape_cell) == round(0.15 * len(shapes) * len(cells))
    for c in colors:  # each row and column of each table keeps trained pairs
        assert any((c, s) not in held.color_shape for s in shapes)
    for s in shapes:
        assert any((c, s) not in held.color_shape for c in colors)
        assert any((s, k) not in held.shape_cell for k in cells)
    for k in cells:
        assert any((s, k) not in held.shape_cell for s in shapes)


def test_the_split_depends_on_its_own_seed_only():
    a = _held(load_config("configs/tiny.py", []))
    assert _held(load_config("configs/tiny.py", ["data.seed=5", "seed=3", "train.steps=7"])) == a
    assert _held(load_config("configs/tiny.py", ["data.heldout_seed=1"])) != a
    assert not _held(load_config("configs/tiny.py", ["data.heldout_frac=0.0"]))


def _train_indices(cfg, steps: int) -> np.ndarray:
    """Every dataset index the trainer's input reads in `steps` steps (the stage's global order, all processes)."""
    b = cfg.train.global_batch
    stage = pipeline.make_stages(cfg.data, b)[0]
    positions = np.arange(steps * b)
    indices = stage.order.order(positions)  # FlatOrder's global permutation, vectorised
    assert [stage.order(int(p) // b, int(p) % b) for p in positions[::997]] == indices[::997].tolist()
    return indices


def test_the_readme_run_never_reads_a_heldout_composition():
    cfg = load_config("configs/tiny.py", [])
    held = _held(cfg)
    ds = pipeline.dataset_from_config(cfg.data)
    indices = _train_indices(cfg, cfg.train.steps)  # the whole run: 8,000 steps of 8
    assert len(indices) == cfg.train.steps * cfg.train.global_batch == 64_000
    scenes = [ds.scene(int(i)) for i in indices]
    assert not any(held.in_scene(s) for s in scenes)
    # Every color, shape and cell is still trained on, and so is every trained color-shape pair.
    objects = [o for s in scenes for o in s.objects]
    assert {o.color for o in objects} == set(synthetic.COLOR_NAMES)
    assert {o.shape for o in objects} == set(synthetic.SHAPES)
    assert {o.cell for o in objects} == set(range(9))
    pairs = {(c, s) for c in synthetic.COLOR_NAMES for s in synthetic.SHAPES}
    assert {(o.color, o.shape) for o in objects} == pairs - held.color_shape


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_what_each_process_reads_is_the_training_split(processes):
    # The batches the input pipeline yields, on any process count, carry the trained captions of their indices.
    cfg = load_config(
        "configs/tiny.py", ["data.max_objects=3", "text.max_len=32", "data.seed=7", "data.worker_threads=0"]
    )
    held, ds, b = _held(cfg), pipeline.dataset_from_config(cfg.data), cfg.train.global_batch
    rows = []
    for p in range(processes):
        it = pipeline.make_batch_iterator(cfg.data, cfg.text.max_len, b, p, processes, 3 * b, text_cfg=cfg.text)
        for _ in range(2):
            batch = next(it)
            for i, tokens, mask in zip(batch["index"], batch["tokens"], batch["text_mask"], strict=True):
                scene = synthetic.parse_caption(tokenizer.decode(tokens, mask))
                assert scene == ds.scene(int(i)) and not held.in_scene(scene)
                rows.append(int(i))
    want = _train_indices(cfg, 5)[3 * b :]  # steps 3 and 4 of the global order, in process order
    assert sorted(rows) == sorted(want.tolist())


def test_unseen_captions_hold_a_heldout_composition_and_seen_ones_do_not():
    cfg = load_config("configs/tiny.py", ["data.max_objects=3"])
    held = _held(cfg)
    unseen, seen = (pipeline.eval_dataset(cfg.data, s) for s in ("unseen", "seen"))
    train = pipeline.dataset_from_config(cfg.data)
    assert all(held.in_scene(unseen.scene(i)) for i in range(500))
    assert not any(held.in_scene(seen.scene(i)) for i in range(500))
    # Three streams: the same index draws three different scenes (no split shares a draw with another).
    same = sum(train.scene(i) == seen.scene(i) for i in range(500))
    assert same < 25, same  # chance agreement of two independent draws of up-to-3-object scenes is rare
    assert unseen.key(3, 1) != seen.key(3, 1) != train.key(3, 1)
    batch = vloss.eval_batch(cfg, 8, "unseen")
    assert batch["index"].tolist() == list(range(8)) and batch["image"].shape == (8, 32, 32, 3)


def test_no_heldout_fraction_is_every_scene_as_before_and_has_no_unseen_split():
    cfg = load_config("configs/tiny.py", ["data.heldout_frac=0.0"])
    ds = pipeline.dataset_from_config(cfg.data)
    plain = synthetic.SyntheticShapes(32, cfg.data.num_samples, 0, 1, render="fixed")
    assert [ds.scene(i) for i in range(200)] == [plain.scene(i) for i in range(200)]
    assert np.array_equal(ds[5]["image"], plain[5]["image"])
    assert pipeline.eval_splits(cfg.data) == ("seen",)
    with pytest.raises(ValueError, match="unseen split needs held-out compositions"):
        pipeline.eval_dataset(cfg.data, "unseen")
    with pytest.raises(ValueError, match=r"heldout_frac=0.6"):
        split.held_out(0.6, 0, synthetic.COLOR_NAMES, synthetic.SHAPES, 9)


def test_a_saved_config_from_before_the_split_reads_as_trained_on_everything():
    from reve_jax import config

    cfg = load_config("configs/tiny.py", [])
    saved = config.to_json(cfg)
    import json

    old = json.loads(saved)
    del old["data"]["heldout_frac"], old["data"]["heldout_seed"]
    assert config.from_json(json.dumps(old)).data.heldout_frac == 0.0
    assert config.from_json(saved).data.heldout_frac == 0.15


def test_scores_by_group_split_the_captions_by_held_out_pair_and_size():
    """alignment.by_group: each caption counted once among the held-out kinds and once among the sizes, each
    group's align_exact and align_shape the share of its captions whose checks all pass (and whose shape does)."""
    from reve_jax.data.synthetic import SceneObject, alignment
    from reve_jax.data.synthetic.grammar import Scene

    held = split.Compositions(frozenset({("red", "circle")}), frozenset({("square", 4)}))
    scenes = [
        Scene("white", (SceneObject("circle", "red", "small", 0),)),  # color-shape
        Scene("white", (SceneObject("circle", "red", "large", 1),)),  # color-shape
        Scene("white", (SceneObject("square", "blue", "small", 4),)),  # shape-cell
        Scene("white", (SceneObject("square", "red", "large", 4),)),  # shape-cell (red square is trained)
        Scene("white", (SceneObject("circle", "red", "small", 2), SceneObject("square", "blue", "large", 4))),  # both
        Scene("white", (SceneObject("cross", "green", "small", 3),)),  # none
    ]
    assert [held.kinds(s) for s in scenes] == ["color-shape"] * 2 + ["shape-cell"] * 2 + ["both", "none"]
    n = len(scenes)
    ok = np.array([[1, 1]] * n)
    checks = {a: ok.copy() for a in alignment.ATTRIBUTES}
    checks["shape"] = np.array([[0, 1], [1, 1], [1, 1], [0, 1], [1, 2], [1, 1]])  # wrong: 0, 3 and one of 4's
    checks["color"] = np.array([[1, 1], [1, 1], [0, 1], [1, 1], [2, 2], [1, 1]])  # wrong: 2
    got = alignment.by_group(checks, scenes, held)
    want = {  # group: (captions, exact, shape right)
        "held-out color-shape": (2, 1 / 2, 1 / 2),
        "held-out shape-cell": (2, 0.0, 1 / 2),
        "held-out both": (1, 0.0, 1 / 2),
        "no held-out pair": (1, 1.0, 1.0),
        "small": (3, 1 / 3, 2 / 3),  # 0, 2, 5
        "large": (2, 1 / 2, 1 / 2),  # 1, 3
        "mixed": (1, 0.0, 1 / 2),  # 4
    }
    assert list(got) == list(want)
    for g, (count, exact, shape) in want.items():
        assert got[g]["n"] == count and got[g]["align_exact"] == pytest.approx(exact), (g, got[g])
        assert got[g]["align_shape"] == pytest.approx(shape), (g, got[g])

"""The synthetic dataset, its tokenizer and the Grain pipeline (fast: small images, few samples)."""

import hashlib
import importlib.util
import itertools
import math
import pathlib

import numpy as np
import pytest

from reve_jax.data import pipeline, synthetic, tokenizer
from reve_jax.data.synthetic import COLORS, Scene, SceneObject, SyntheticShapes

_BASE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "base.py"


def _data_cfg(**overrides):
    """The real base config's `data` section (so tests follow its keys), with small test overrides."""
    spec = importlib.util.spec_from_file_location("_base_config", _BASE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config().data
    cfg.update({"image_size": 12, "num_samples": 24, "worker_threads": 1, "prefetch": 1, **overrides})
    return cfg


# ---------------------------------------------------------------- synthetic


def test_deterministic_by_seed_and_index_in_any_order():
    a, b = SyntheticShapes(32, 1000, seed=3), SyntheticShapes(32, 1000, seed=3)
    order = [7, 0, 999, 7, 42, 3]
    first = {i: a[i] for i in order}
    for i in reversed(order):
        s = b[i]
        assert s["caption"] == first[i]["caption"] and s["description"] == first[i]["description"]
        np.testing.assert_array_equal(s["image"], first[i]["image"])
    other = SyntheticShapes(32, 1000, seed=4)
    assert [other.caption(i) for i in range(10)] != [a.caption(i) for i in range(10)]


def test_getitem_contract_and_bounds():
    ds = SyntheticShapes(32, 10)
    s = ds[np.int64(9)]
    assert s["image"].dtype == np.uint8 and s["image"].shape == (32, 32, 3)
    assert isinstance(s["caption"], str) and isinstance(s["description"], Scene)
    assert len(ds) == 10
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(ValueError, match="max_objects"):
        SyntheticShapes(32, 10, max_objects=10)


@pytest.mark.parametrize("size", [32, 64])
def test_every_attribute_is_rendered(size):
    ds = SyntheticShapes(size, 10_000, seed=1, max_objects=4, render="fixed")
    seen_counts = set()
    for i in range(120):
        s = ds[i]
        img, scene = s["image"], s["description"]
        bg = np.asarray(COLORS[scene.background])
        seen_counts.add(len(scene.objects))
        for corner in (img[0, 0], img[0, -1], img[-1, 0], img[-1, -1]):
            np.testing.assert_array_equal(corner, bg)
        cells = {o.cell: o for o in scene.objects}
        step = size / 3
        for cell in range(9):
            r, c = divmod(cell, 3)
            rows, cols = (
                slice(round(r * step), round((r + 1) * step)),
                slice(round(c * step), round((c + 1) * step)),
            )
            block = img[rows, cols]
            if cell not in cells:  # an empty cell is pure background: the object count and cells match
                assert (block == bg).all(), (i, cell)
                continue
            obj = cells[cell]
            assert obj.color != scene.background
            # Shape and size: fully covered pixels have the object's color, uncovered ones the background's.
            cov = synthetic.object_coverage(obj, size)
            assert (img[cov == 1.0] == COLORS[obj.color]).all() and (cov == 1.0).sum() > 0
            assert (block[cov[rows, cols] == 0] == bg).all()
            cy, cx = synthetic.cell_center(cell, size)
            center = img[int(cy), int(cx)]
            # From 31 px up every shape covers the pixel at its cell center fully.
            np.testing.assert_array_equal(center, COLORS[obj.color])
    assert seen_counts == {1, 2, 3, 4}


def test_caption_states_every_attribute():
    ds = SyntheticShapes(32, 1000, max_objects=3)
    for i in range(300):
        cap, scene = ds.caption(i), ds.scene(i)
        assert synthetic.parse_caption(cap) == scene
        assert cap.endswith(f" {scene.background} background")
        for o in scene.objects:
            assert f"a {o.size} {o.color} {o.shape} {synthetic.CELL_PHRASES[o.cell]}" in cap
        assert Scene.from_dict(scene.to_dict()) == scene
    with pytest.raises(ValueError):
        synthetic.parse_caption("a photo of a cat")


def test_caption_drop_leaves_words_out_of_training_captions_only():
    """data.caption_drop: each object word of a training caption is left out apart, at the set rate, drawn from
    the sample's key; images, scenes and evaluation captions are those of the dataset without it."""
    heldout = pipeline.heldout_compositions(_data_cfg())
    full = SyntheticShapes(16, 10_000, max_objects=2, render="fixed", heldout=heldout)
    drop = SyntheticShapes(16, 10_000, max_objects=2, render="fixed", heldout=heldout, caption_drop=0.3)
    missing, objects = dict.fromkeys(synthetic.OMITTABLE, 0), 0
    for i in range(1500):
        scene, cap = drop.scene(i), drop[i]["caption"]
        assert scene == full.scene(i) and cap == drop.caption(i)  # the same scene; one caption per index
        assert "<unk>" not in tokenizer.decode(tokenizer.encode(cap, 64)[0])
        assert cap.endswith(f", on {'an' if scene.background[0] in 'aeiou' else 'a'} {scene.background} background")
        phrases = cap.rsplit(", on ", 1)[0].replace(" and ", ", ").split(", ")
        assert len(phrases) == len(scene.objects)
        for o, phrase in zip(scene.objects, phrases, strict=True):
            words = {"size": o.size, "color": o.color, "shape": o.shape, "position": synthetic.CELL_PHRASES[o.cell]}
            kept = [a for a in synthetic.OMITTABLE if f" {words[a]}" in f" {phrase}"]
            assert phrase == " ".join(["a", *(words[a] for a in kept)])  # the remaining words, in caption order
            objects += 1
            for a in synthetic.OMITTABLE:
                missing[a] += a not in kept
    for a, n in missing.items():  # 0.3 each; the standard error over ~2,250 objects is 0.01
        assert abs(n / objects - 0.3) < 0.04, (a, n / objects)
    np.testing.assert_array_equal(drop[7]["image"], full[7]["image"])
    for which in ("unseen", "seen"):  # evaluation captions state every attribute
        want = [full.with_split(which).caption(i) for i in range(50)]
        assert [drop.with_split(which).caption(i) for i in range(50)] == want
    assert drop.with_split("seen").with_split("train").caption(3) == drop.caption(3)  # the rate carries over
    assert pipeline.dataset_from_config(_data_cfg(caption_drop=0.3)).caption_drop == 0.3
    with pytest.raises(ValueError, match="caption_drop"):
        SyntheticShapes(16, 10, caption_drop=1.0)
    with pytest.raises(ValueError, match="cannot leave out"):
        synthetic.caption_of(full.scene(0), (frozenset({"background"}),))


def _object_centroid(img: np.ndarray, background: str) -> np.ndarray:
    """(y, x) of the pixel-center mean weighted by how far each pixel is from the background color (pixel i spans
    [i, i+1)): the object's centroid, read from the image alone."""
    w = np.abs(img.astype(np.float64) - COLORS[background]).sum(-1)
    ys, xs = np.mgrid[: img.shape[0], : img.shape[1]] + 0.5
    return np.array([(w * ys).sum(), (w * xs).sum()]) / w.sum()


def test_shift_moves_training_objects_within_their_cells_and_leaves_evaluation_centered():
    """data.shift: in the train split each object moves up to `shift` pixels per axis from its cell's center (read
    from the images: the centroid against the centered image's), uniformly; the scenes, captions and evaluation
    images are the unshifted dataset's; the reader still reads every shifted image right."""
    heldout = pipeline.heldout_compositions(_data_cfg())
    kw = dict(max_objects=1, render="fixed", heldout=heldout)
    full, sh = SyntheticShapes(32, 10_000, **kw), SyntheticShapes(32, 10_000, **kw, shift=1.5)
    moves = []
    for i in range(300):
        a, b = full[i], sh[i]
        assert a["caption"] == b["caption"] and a["description"] == b["description"]
        np.testing.assert_array_equal(b["image"], sh.image(i))  # one image per index, as the pipeline reads it
        bg = a["description"].background
        moves.append(_object_centroid(b["image"], bg) - _object_centroid(a["image"], bg))
    moves = np.array(moves)
    assert np.abs(moves).max() <= 1.5 + 0.1, np.abs(moves).max()  # 8-bit rounding of the blended edges
    assert np.abs(moves).max(axis=0).min() > 1.3  # both axes reach the bound
    np.testing.assert_allclose(moves.std(axis=0), 1.5 / math.sqrt(3), rtol=0.15)  # uniform on [-1.5, 1.5]
    assert not np.array_equal(sh.image(5, variant=1), sh.image(5))  # another draw of the same caption
    for which in ("unseen", "seen"):
        ev, ev_full = sh.with_split(which), full.with_split(which)
        assert ev.shift == 1.5
        for i in range(20):
            np.testing.assert_array_equal(ev[i]["image"], ev_full[i]["image"])
    from reve_jax.data.synthetic import alignment

    scores = alignment.score(np.stack([sh[i]["image"] for i in range(128)]), [sh.scene(i) for i in range(128)])
    assert scores["align_exact"] == 1.0, scores
    assert pipeline.dataset_from_config(_data_cfg(render="fixed", shift=1.0)).shift == 1.0
    np.testing.assert_array_equal(SyntheticShapes(32, 10, **kw, shift=0.0)[3]["image"], full[3]["image"])
    for bad in (dict(render="fixed", shift=-1.0), dict(render="jitter", shift=1.0)):
        with pytest.raises(ValueError, match="data.shift"):
            SyntheticShapes(32, 10, **bad)


def test_sizes_and_shapes_differ_at_every_resolution():
    for size in (32, 64, 256, 512):
        areas = {
            (shape, sz): synthetic.object_coverage(SceneObject(shape, "red", sz, 4), size).sum()
            for shape in synthetic.SHAPES
            for sz in synthetic.SIZES
        }
        for shape in synthetic.SHAPES:
            assert areas[shape, "large"] > 2.5 * areas[shape, "small"] > 0
        masks = [synthetic.object_coverage(SceneObject(s, "red", "large", 0), size) for s in synthetic.SHAPES]
        for m1, m2 in itertools.combinations(masks, 2):
            assert np.abs(m1 - m2).sum() > 0.05 * m1.sum()
        scene = Scene("white", (SceneObject("triangle", "black", "large", 8),))
        img = synthetic.render_scene(scene, size)
        assert img.shape == (size, size, 3)
        # Anti-aliased edges: some pixels are strictly between the two colors.
        assert ((img[..., 0] > 15) & (img[..., 0] < 245)).any()


def test_fixed_rendering_is_bit_for_bit_the_earlier_one():
    # Hash of these images and captions from the code before the jittered rendering existed.
    h = hashlib.sha256()
    for size in (16, 32, 64):
        for max_objects in (1, 3):
            ds = SyntheticShapes(size, 1000, 5, max_objects, render="fixed")
            for i in range(20):
                s = ds[i]
                h.update(s["image"].tobytes())
                h.update(s["caption"].encode())
    assert h.hexdigest() == "6ac7f7048a25e4b1a92501be162818d64e0af03a7b5d0c3e11de06bf8d96c988"


def test_jitter_gives_each_caption_a_distribution():
    fixed, jitter = SyntheticShapes(32, 1000, 2, render="fixed"), SyntheticShapes(32, 1000, 2)
    assert jitter.render == "jitter"
    for i in range(20):
        assert jitter.caption(i) == fixed.caption(i) and jitter.scene(i) == fixed.scene(i)  # same captions
        a, b = jitter.image(i), jitter.image(i, variant=1)
        np.testing.assert_array_equal(a, jitter[i]["image"])
        assert np.abs(a.astype(int) - b).max() > 3, i  # another image of the same caption
        assert not np.array_equal(a, fixed[i]["image"])
    np.testing.assert_array_equal(fixed.image(3, variant=1), fixed[3]["image"])  # fixed: one image per caption
    # Jittered scenes differ in what the caption does not fix: positions, sizes, turns, shades.
    styles = [jitter.style(i) for i in range(200)]
    objs = [o for st in styles for o in st.objects]
    assert np.std([o.dx for o in objs]) > 0.05 and np.std([o.r for o in objs]) > 0.03
    assert len({round(o.angle) for o in objs}) > 20 and len({st.rgb for st in styles}) == 200


def test_jitter_geometry_grows_from_fixed_at_16px_to_full_at_32px():
    assert [synthetic.geometry_strength(s) for s in (9, 16, 24, 32, 128)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    scene = Scene("white", (SceneObject("triangle", "red", "small", 4),))
    drawn = synthetic.sample_style(np.random.default_rng(0), scene, strength=0.0)
    np.testing.assert_allclose(  # no geometric variation left: the fixed rendering's coverage
        synthetic.render_jittered(scene, drawn, 16)[..., 1] < 200, synthetic.render_scene(scene, 16)[..., 1] < 200
    )


@pytest.mark.parametrize("size", [16, 24, 32, 64, 128])
def test_jittered_objects_stay_readable(size):
    """Every stated attribute stays checkable: an object stays inside its cell (a margin from the edge), its
    half-extent in its size class's range (the classes do not overlap), its shade nearest its own palette color,
    and pixels away from every object are background (shade, gradient and texture within their bounds)."""
    ds = SyntheticShapes(size, 10_000, seed=3, max_objects=4)
    jit, cw = synthetic.JITTER, size / 3
    palette = np.array([COLORS[c] for c in synthetic.COLOR_NAMES], float)
    for i in range(40):
        sample, style = ds[i], ds.style(i)
        img, scene = sample["image"].astype(float), sample["description"]
        occupied = np.zeros((size, size), bool)
        t = np.arange(size) + 0.5
        for o, st in zip(scene.objects, style.objects, strict=True):
            lo, hi = jit.small if o.size == "small" else jit.large
            assert lo - 1e-9 <= st.r <= hi + 1e-9 or ds.strength < 1
            ey, ex = synthetic.shape_extent(o.shape, st.r, st.angle)
            if ds.strength == 1:
                assert abs(st.dy) + ey <= 0.5 - jit.margin + 1e-9 and abs(st.dx) + ex <= 0.5 - jit.margin + 1e-9
            nearest = np.square(palette - st.rgb).sum(1).argmin()
            assert synthetic.COLOR_NAMES[nearest] == o.color
            cy, cx = (o.row + 0.5 + st.dy) * cw, (o.col + 0.5 + st.dx) * cw
            cov = synthetic.shape_coverage(o.shape, t[:, None] - cy, t[None, :] - cx, st.r * cw, st.angle)
            rows, cols = np.nonzero(cov > 0)
            assert rows.min() >= math.floor(o.row * cw) - 1 and rows.max() < math.ceil((o.row + 1) * cw) + 1
            assert cols.min() >= math.floor(o.col * cw) - 1 and cols.max() < math.ceil((o.col + 1) * cw) + 1
            if (cov == 1.0).any():  # the 16 px small objects cover no pixel fully
                assert np.abs(img[cov == 1.0] - st.rgb).max() <= 1.0
            occupied |= cov > 0
        bound = jit.gradient + jit.texture + 1.0
        assert np.abs(img[~occupied] - style.rgb).max() <= bound, i
        assert np.abs(np.subtract(style.rgb, COLORS[scene.background])).max() <= jit.shade + 1e-9


def test_scene_knobs_and_their_errors():
    ds = SyntheticShapes(16, 1000, 0, max_objects=4, min_objects=2, shapes=("circle", "cross"), colors=("red", "blue"))
    for i in range(100):
        scene = ds.scene(i)
        assert 2 <= len(scene.objects) <= 4 and scene.background in ("red", "blue")
        assert all(o.shape in ("circle", "cross") and o.color != scene.background for o in scene.objects)
    # The default knobs draw the earlier scenes.
    assert SyntheticShapes(16, 1000, 0, 3, shapes=synthetic.SHAPES).scene(7) == SyntheticShapes(16, 1000, 0, 3).scene(7)
    for kwargs, match in (
        ({"min_objects": 4}, "min_objects"),
        ({"shapes": ("circle", "star")}, "shapes"),
        ({"colors": ("red",)}, "colors"),
        ({"render": "smooth"}, "render"),
    ):
        with pytest.raises(ValueError, match=match):
            SyntheticShapes(16, 10, 0, 3, **kwargs)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_every_caption_without_unk():
    ds = SyntheticShapes(32, 100_000, max_objects=9)
    for i in range(400):
        cap = ds.caption(i)
        ids, mask = tokenizer.encode(cap, 96)
        assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape == (96,)
        assert tokenizer.UNK_ID not in ids[mask] and (ids[~mask] == tokenizer.PAD_ID).all()
        assert mask.sum() == tokenizer.num_tokens(cap)
        assert tokenizer.decode(ids, mask) == cap == tokenizer.decode(ids)


def test_vocabulary_covers_every_caption_word():
    words = set(" ".join((*COLORS, *synthetic.SHAPES, *synthetic.SIZES, *synthetic.CELL_PHRASES)).split())
    words |= {"a", "an", "and", "on", "background", ","}
    assert words <= set(tokenizer.VOCAB)
    assert tokenizer.VOCAB[0] == tokenizer.PAD and len(set(tokenizer.VOCAB)) == tokenizer.VOCAB_SIZE
    # The base config's text.max_len=32 holds the longest caption of the default max_objects=3.
    assert tokenizer.num_tokens(synthetic.longest_caption(3)) <= 32


def test_tokenizer_truncation_unknown_and_batch():
    ids, mask = tokenizer.encode("A Red zebra, on", 3)
    assert mask.all() and ids[0] == tokenizer.VOCAB.index("a") and ids[2] == tokenizer.UNK_ID
    assert tokenizer.decode(*tokenizer.encode("red circle.", 8)) == "red circle."
    ids, mask = tokenizer.encode_batch(["red", "a blue square"], 5)
    assert ids.shape == (2, 5) and mask.sum(1).tolist() == [1, 3]


# ---------------------------------------------------------------- global order and pipeline


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
def test_global_order_is_a_fresh_permutation_each_epoch(n):
    order = pipeline.GlobalOrder(n, seed=5)
    idx = order(np.arange(3 * n))
    for e in range(3):
        assert sorted(idx[e * n : (e + 1) * n].tolist()) == list(range(n))
    if n >= 100:
        assert not np.array_equal(idx[:n], idx[n : 2 * n])
        assert not np.array_equal(idx[:n], pipeline.GlobalOrder(n, seed=6)(np.arange(n)))
    assert [int(order(k)) for k in range(0, 3 * n, max(1, n // 7))] == idx[:: max(1, n // 7)].tolist()


def _take(it, k):
    return [next(it) for _ in range(k)]


def _concat(batches):
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def _assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_batch_contract():
    cfg = _data_cfg()
    (b,) = _take(pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 0), 1)
    assert set(b) == {"image", "tokens", "text_mask", "index"}
    assert b["image"].dtype == np.uint8 and b["image"].shape == (8, 12, 12, 3)
    assert b["tokens"].dtype == np.int32 and b["tokens"].shape == (8, 32)
    assert b["text_mask"].dtype == bool and b["index"].dtype == np.int64
    ds = pipeline.dataset_from_config(cfg)
    np.testing.assert_array_equal(b["index"], pipeline.GlobalOrder(24, cfg.seed)(np.arange(8)))
    for row, i in enumerate(b["index"]):
        s = ds[int(i)]
        np.testing.assert_array_equal(b["image"][row], s["image"])
        assert tokenizer.decode(b["tokens"][row], b["text_mask"][row]) == s["caption"]
    assert pipeline.captions_of(ds, b["index"]) == [ds.caption(int(i)) for i in b["index"]]


def test_process_slices_concatenate_to_the_global_batch():
    cfg = _data_cfg()
    whole = _take(pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 0), 3)
    parts = [_take(pipeline.make_batch_iterator(cfg, 32, 8, p, 2, 0), 3) for p in range(2)]
    _assert_batches_equal(whole, [_concat(pair) for pair in zip(*parts, strict=True)])


def test_resume_matches_a_fresh_iterator():
    cfg = _data_cfg()
    fresh = _take(pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 0), 5)
    resumed = _take(pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 16), 3)
    _assert_batches_equal(fresh[2:], resumed)


def test_batches_do_not_depend_on_worker_threads_or_processes():
    """A whole batch is one Grain element, so any number of threads or worker processes builds the same batches
    (the processes' batches are read back in order), from the start and from a resumed position."""
    reference = _take(pipeline.make_batch_iterator(_data_cfg(worker_threads=0), 32, 8, 0, 1, 0), 5)
    _assert_batches_equal(
        _take(pipeline.make_batch_iterator(_data_cfg(worker_threads=3), 32, 8, 0, 1, 0), 5), reference
    )
    it = pipeline.make_batch_iterator(_data_cfg(worker_threads=1, worker_processes=2, prefetch=2), 32, 8, 0, 1, 16)
    try:
        _assert_batches_equal(_take(it, 3), reference[2:])
    finally:
        it.close()


def test_epoch_covers_every_index_once_and_is_endless():
    cfg = _data_cfg()
    it = pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 0)
    epochs = [np.concatenate([b["index"] for b in _take(it, 3)]) for _ in range(3)]  # 24 samples per epoch
    for idx in epochs:
        assert sorted(idx.tolist()) == list(range(24))
    assert not np.array_equal(epochs[0], epochs[1])


def test_changing_process_count_continues_the_global_sequence():
    cfg = _data_cfg()
    whole = _take(pipeline.make_batch_iterator(cfg, 32, 8, 0, 1, 0), 4)
    first = [_take(pipeline.make_batch_iterator(cfg, 32, 8, p, 2, 0), 2) for p in range(2)]
    # Two processes consumed 2 global batches (position 16); four processes take over from there.
    then = [_take(pipeline.make_batch_iterator(cfg, 32, 8, p, 4, 16), 2) for p in range(4)]
    got = [_concat(g) for g in zip(*first, strict=True)] + [_concat(g) for g in zip(*then, strict=True)]
    _assert_batches_equal(whole, got)
    np.testing.assert_array_equal(pipeline.local_positions(8, 1, 4, 16, 2), [[18, 19], [26, 27]])


def test_dataset_from_config_passes_the_scene_knobs():
    cfg = _data_cfg(min_objects=2, max_objects=2, shapes=("square",), colors=("red", "white"), render="fixed")
    ds = pipeline.dataset_from_config(cfg)
    assert (ds.min_objects, ds.shapes, ds.colors, ds.render) == (2, ("square",), ("red", "white"), "fixed")
    assert pipeline.dataset_from_config(_data_cfg()).render == "jitter"  # the default for new runs


def test_clear_errors():
    cfg = _data_cfg()
    with pytest.raises(ValueError, match="not divisible by process_count"):
        pipeline.make_batch_iterator(cfg, 32, 6, 0, 4, 0)
    with pytest.raises(ValueError, match="multiple of train.global_batch"):
        pipeline.make_batch_iterator(cfg, 32, 8, 0, 2, 12)
    with pytest.raises(ValueError, match="multiple of train.global_batch"):
        pipeline.make_batch_iterator(cfg, 32, 8, 0, 2, -8)
    with pytest.raises(ValueError, match="process_index"):
        pipeline.make_batch_iterator(cfg, 32, 8, 2, 2, 0)
    with pytest.raises(ValueError, match="text.max_len"):
        pipeline.make_batch_iterator(cfg, 16, 8, 0, 1, 0)
    with pytest.raises(ValueError, match="data.name='shards'"):
        pipeline.dataset_from_config(_data_cfg(name="shards"))
    with pytest.raises(ValueError, match="unknown data.name"):
        pipeline.dataset_from_config(_data_cfg(name="imagenet"))
